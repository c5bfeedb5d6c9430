"""`triage`: says what a support request is about and how urgent it is. Reads only."""

from google.adk.agents import LlmAgent

from agents.standalone import setup_django

setup_django()

from agents import tools  # noqa: E402 - the tools use Django's models

DEFAULT_SCRIPT = [
    {"call": "lookup_customer", "args": {"email": "jane@example.com"}},
    {"say": "Jane Doe (pro plan) asks where her refund is. Priority: normal; she is a paying customer."},
]

root_agent = LlmAgent(
    name="triage",
    model="gemini-2.5-flash",
    description="Reads a support request and says what it is about and how urgent it is. Reads only.",
    instruction=(
        "You triage customer support requests. Look the customer up, then say in two sentences "
        "what the request is about and how urgent it is. Never contact the customer."
    ),
    tools=[tools.lookup_customer],
)
