"""`support`: answers a customer — looks them up, emails them, logs a CRM note, refunds an order.

A refund above `tools.REFUND_APPROVAL_ABOVE_CENTS` waits for a person's approval (ADK's own
`require_confirmation`); a return label is asked of the warehouse, which answers later (ADK's
`LongRunningFunctionTool`).
"""

from google.adk.agents import LlmAgent
from google.adk.tools import FunctionTool
from google.adk.tools.long_running_tool import LongRunningFunctionTool
from google.adk.tools.preload_memory_tool import preload_memory_tool

from agents.standalone import setup_django

setup_django()

from agents import tools  # noqa: E402 - the tools use Django's models

# What the offline scripted model plays when a run brings no script of its own.
DEFAULT_SCRIPT = [
    {"call": "lookup_customer", "args": {"email": "jane@example.com"}},
    {
        "call": "send_email",
        "args": {
            "to": "jane@example.com",
            "subject": "Your refund",
            "body": "Hello Jane, your refund has been issued and will arrive in 3-5 days.",
        },
    },
    {"call": "update_crm", "args": {"contact_id": "C-1001", "note": "Refund confirmed by email."}},
    {"say": "I looked Jane up, emailed her about her refund and noted it in the CRM."},
]

root_agent = LlmAgent(
    name="support",
    model="gemini-2.5-flash",
    description="Answers a customer: looks them up, emails them and logs a CRM note.",
    instruction=(
        "You are a customer support agent. Look the customer up before acting, answer by "
        "email with send_email, record what you did with update_crm, then summarise in one "
        "sentence. Never send the same email twice. Refund an order with issue_refund when the "
        "customer is owed money; ask the warehouse for a return label with request_return_label."
    ),
    # ADK's preload_memory puts what this owner told the agent in earlier runs before the model.
    tools=[
        tools.lookup_customer,
        tools.send_email,
        tools.update_crm,
        FunctionTool(tools.issue_refund, require_confirmation=tools.refund_needs_approval),
        LongRunningFunctionTool(tools.request_return_label),
        preload_memory_tool,
    ],
)
