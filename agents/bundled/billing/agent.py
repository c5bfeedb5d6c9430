"""`billing`: checks the customer's plan and what billing can tell them. Reads only."""

from google.adk.agents import LlmAgent

from agents.standalone import setup_django

setup_django()

from agents import tools  # noqa: E402 - the tools use Django's models

DEFAULT_SCRIPT = [
    {"call": "lookup_customer", "args": {"email": "jane@example.com"}},
    {"say": "Jane is on the pro plan; her refund was issued and takes 3-5 business days to arrive."},
]

root_agent = LlmAgent(
    name="billing",
    model="gemini-2.5-flash",
    description="Checks the customer's plan and what billing can tell them. Reads only.",
    instruction=(
        "You check billing facts for a support request. Look the customer up and state their "
        "plan and anything billing-related support should know, in two sentences. Never act."
    ),
    tools=[tools.lookup_customer],
)
