"""The agents Agent Ledger can run, by name.

An agent is built fresh for every run: the scripted model carries that run's script and its
position in it, and nothing leaks from one run into the next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from google.adk.agents import LlmAgent
from google.adk.models.base_llm import BaseLlm
from google.adk.models.registry import LLMRegistry

from agents import diet, tools
from agents.preload import PreloadMemoryOncePerInvocation
from agents.retrying import RetryingLlm
from agents.scripted import ScriptedLlm, validate_script


class UnknownAgentError(LookupError):
    def __init__(self, name: str):
        self.name = name
        known = ", ".join(sorted(AGENTS)) or "none"
        super().__init__(f"There is no agent named {name!r}. Registered agents: {known}.")


@dataclass(frozen=True)
class AgentSpec:
    name: str
    description: str
    instruction: str
    tools: tuple[Callable[..., Any], ...]
    default_script: tuple[Any, ...]
    # Callbacks other parts of the system add to every agent (e.g. the memory diet).
    before_model_callbacks: tuple[Callable[..., Any], ...] = field(default=())
    # ADK tools the model never calls, which shape each request (e.g. memory preloading); a
    # class is instantiated for each agent built, so per-run state stays with its run.
    context_tools: tuple[Any, ...] = field(default=())

    @property
    def tool_names(self) -> list[str]:
        return [tool.__name__ for tool in self.tools]


SUPPORT = AgentSpec(
    name="support",
    description="Answers a customer: looks them up, emails them and logs a CRM note.",
    instruction=(
        "You are a customer support agent. Look the customer up before acting, answer by "
        "email with send_email, record what you did with update_crm, then summarise in one "
        "sentence. Never send the same email twice."
    ),
    tools=(tools.lookup_customer, tools.send_email, tools.update_crm),
    default_script=(
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
    ),
    # What this owner told the agent in earlier successful runs is put before the model.
    context_tools=(PreloadMemoryOncePerInvocation,),
)

# Read-only agents for workflows: they look a customer up and report, and never act.
TRIAGE = AgentSpec(
    name="triage",
    description="Reads a support request and says what it is about and how urgent it is. Reads only.",
    instruction=(
        "You triage customer support requests. Look the customer up, then say in two sentences "
        "what the request is about and how urgent it is. Never contact the customer."
    ),
    tools=(tools.lookup_customer,),
    default_script=(
        {"call": "lookup_customer", "args": {"email": "jane@example.com"}},
        {"say": "Jane Doe (pro plan) asks where her refund is. Priority: normal; she is a paying customer."},
    ),
)

BILLING = AgentSpec(
    name="billing",
    description="Checks the customer's plan and what billing can tell them. Reads only.",
    instruction=(
        "You check billing facts for a support request. Look the customer up and state their "
        "plan and anything billing-related support should know, in two sentences. Never act."
    ),
    tools=(tools.lookup_customer,),
    default_script=(
        {"call": "lookup_customer", "args": {"email": "jane@example.com"}},
        {"say": "Jane is on the pro plan; her refund was issued and takes 3-5 business days to arrive."},
    ),
)

AGENTS: dict[str, AgentSpec] = {spec.name: spec for spec in (SUPPORT, TRIAGE, BILLING)}

# Callbacks every agent gets before its own: old turns go to the model without their large
# base64 payloads (the stored session keeps them).
COMMON_BEFORE_MODEL_CALLBACKS: tuple[Callable[..., Any], ...] = (diet.strip_old_payloads,)


def get_agent_spec(name: str) -> AgentSpec:
    try:
        return AGENTS[name]
    except KeyError:
        raise UnknownAgentError(name) from None


def uses_scripted_model() -> bool:
    return settings.AGENT_MODEL == "scripted"


def validate_params(spec: AgentSpec, params: dict) -> None:
    """Raise ScriptError (a ValueError) if the run's parameters cannot be played."""
    if uses_scripted_model() and "script" in params:
        validate_script(
            params["script"],
            tool_names=spec.tool_names,
            faults_enabled=settings.SCRIPTED_FAULTS_ENABLED,
        )


def build_model(spec: AgentSpec, params: dict) -> RetryingLlm:
    """The agent's model, wrapped so rate limits and empty turns are retried at the call."""
    if uses_scripted_model():
        script = params.get("script") or list(spec.default_script)
        inner: BaseLlm = ScriptedLlm(script=script)
    else:
        # With GOOGLE_API_KEY set, ADK's registry resolves the Gemini model; scripts are ignored.
        inner = LLMRegistry.new_llm(settings.AGENT_MODEL)
    return RetryingLlm(inner=inner)


def build_agent(spec: AgentSpec, *, params: dict) -> LlmAgent:
    return LlmAgent(
        name=spec.name,
        description=spec.description,
        model=build_model(spec, params),
        instruction=spec.instruction,
        tools=[*spec.tools, *(tool() if isinstance(tool, type) else tool for tool in spec.context_tools)],
        before_model_callback=[*COMMON_BEFORE_MODEL_CALLBACKS, *spec.before_model_callbacks] or None,
    )
