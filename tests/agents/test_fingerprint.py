"""The fingerprint of an agent's definition (agents.fingerprint): what a resume must still be talking to."""

from __future__ import annotations

import pytest

from agents import registry
from agents.fingerprint import agent_fingerprint, describe_agent
from tests.helpers import run_python

PACKAGE = '''
from google.adk.agents import LlmAgent
from agents.effects import idempotent, read_only

@read_only
def look(email: str) -> dict:
    """Look someone up."""
    return {"email": email}

@idempotent(key="to")
def mail(to: str, body: str) -> dict:
    """Send mail."""
    return {"sent": to}

helper = LlmAgent(name="helper", model="gemini-2.5-flash", instruction="Help.", tools=[look])
root_agent = LlmAgent(name="{name}", model="{model}", instruction="{instruction}", tools=[{tools}], sub_agents=[helper])
'''
BASE = {"model": "gemini-2.5-flash", "instruction": "Answer customers.", "tools": "look, mail"}


def source(name: str, **changes) -> str:
    text = PACKAGE.replace("{name}", name)
    for key, value in {**BASE, **changes}.items():
        text = text.replace("{" + key + "}", value)
    return text


def fingerprint_of(agents_dir, name: str, **changes) -> str:
    agents_dir(**{name: source(name, **changes)})
    return registry.fingerprint(registry.get_agent_spec(name))


@pytest.mark.parametrize("change", [
    {"instruction": "Answer customers briefly."},
    {"tools": "look"},
    {"model": "gemini-2.5-pro"},
])
def test_a_changed_instruction_tool_or_model_changes_the_fingerprint(agents_dir, change):
    before = fingerprint_of(agents_dir, "fp_same")
    assert fingerprint_of(agents_dir, "fp_same") == before  # loading again changes nothing
    assert fingerprint_of(agents_dir, "fp_same", **change) != before


def test_a_changed_effect_class_or_sub_agent_changes_the_fingerprint(agents_dir):
    before = fingerprint_of(agents_dir, "fp_effect")
    text = source("fp_effect")
    agents_dir(fp_effect=text.replace('@idempotent(key="to")', "@read_only"))
    assert registry.fingerprint(registry.get_agent_spec("fp_effect")) != before
    agents_dir(fp_effect=text.replace('instruction="Help."', 'instruction="Help more."'))
    assert registry.fingerprint(registry.get_agent_spec("fp_effect")) != before


def test_the_description_names_no_object_ids():
    description = repr(describe_agent(registry.get_agent_spec("support").root))
    assert " at 0x" not in description and "send_email" in description and "idempotent" in description


@pytest.mark.slow
def test_two_processes_agree_on_the_fingerprint():
    here = registry.fingerprint(registry.get_agent_spec("support"))
    child = run_python("from agents import registry\nprint(registry.fingerprint(registry.get_agent_spec('support')))")
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split()[-1] == here
    assert here == agent_fingerprint(registry.get_agent_spec("support").root) and len(here) == 64


@pytest.mark.django_db(transaction=True)
def test_a_run_whose_agent_changed_since_it_started_is_refused_a_resume(agents_dir, alice):
    from runs.rules import resume
    from tests.helpers import run_now, script_params

    agents_dir(fp_run=source("fp_run"))
    run = run_now(agent_name="fp_run", params=script_params({"fail": "error", "message": "down"}), created_by=alice)
    assert run.status == "error" and run.agent_fingerprint == registry.fingerprint(registry.get_agent_spec("fp_run"))
    assert resume.decide_resume(run).allowed
    agents_dir(fp_run=source("fp_run", instruction="Answer customers in French."))
    refusal = resume.decide_resume(run).refusal
    assert (refusal.status, refusal.code) == (409, "agent_changed")
    assert "Replay it instead" in refusal.detail
