"""A loaded agent with a real effect (the ledger's outbox), for the crash matrix."""

from google.adk.agents import LlmAgent

from agents.tools import lookup_customer, send_email

notes = LlmAgent(name="notes", model="gemini-2.5-flash", description="Keeps notes.", tools=[lookup_customer])

root_agent = LlmAgent(
    name="mailer",
    model="gemini-2.5-flash",
    description="Emails customers.",
    tools=[lookup_customer, send_email],
    sub_agents=[notes],
)
