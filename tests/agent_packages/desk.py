"""A team's agent tree: a coordinator with two sub-agents (one a ParallelAgent) and an AgentTool."""

from google.adk.agents import LlmAgent, ParallelAgent
from google.adk.tools.agent_tool import AgentTool


def lookup_order(order_id: str) -> dict:
    """Look an order up. Reads only."""
    return {"order_id": order_id, "status": "delivered", "total": 42}


def issue_refund(order_id: str, amount: int) -> dict:
    """Refund part of an order."""
    return {"order_id": order_id, "refunded": amount}


def word_count(text: str) -> dict:
    """Count the words of a text."""
    return {"words": len(text.split())}


def check_carrier(order_id: str) -> dict:
    """Ask the carrier where a parcel is."""
    return {"order_id": order_id, "carrier": "delivered at the door"}


summarizer = LlmAgent(
    name="summarizer", model="gemini-2.5-flash", description="Summarises a text.", tools=[word_count]
)
refunds = LlmAgent(
    name="refunds", model="gemini-2.5-flash", description="Issues refunds.", tools=[lookup_order, issue_refund]
)
research = ParallelAgent(
    name="research",
    description="Checks the carrier and the ledger at the same time.",
    sub_agents=[
        LlmAgent(name="carrier_check", model="gemini-2.5-flash", tools=[check_carrier]),
        LlmAgent(name="ledger_check", model="gemini-2.5-flash", tools=[lookup_order]),
    ],
)

root_agent = LlmAgent(
    name="desk",
    model="gemini-2.5-flash",
    description="Routes a customer's request to refunds or research.",
    instruction="Look the order up, then hand the request to the right agent.",
    tools=[lookup_order, AgentTool(agent=summarizer)],
    sub_agents=[refunds, research],
)

DEFAULT_SCRIPT = [{"call": "lookup_order", "args": {"order_id": "A-1"}}, {"say": "Order A-1 was delivered."}]
