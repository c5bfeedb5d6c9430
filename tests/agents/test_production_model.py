"""Production never plays the demo: without DEBUG the offline model is used only when asked for,
and then only with the scripts a run brings."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured, ValidationError

from agents.models import OutboxEmail
from runs.models.ledger import AgentRun
from tests.helpers import read_settings, run_now


def _settings(**env: str):
    """The settings a process started with `env` reads (or the refusal it stops with), in-process."""
    unset = tuple(name for name in ("AGENT_MODEL", "GOOGLE_API_KEY", "SCRIPTED_DEFAULT_SCRIPTS") if name not in env)
    return read_settings(drop=unset, **env)


def test_production_without_a_model_refuses_to_start_naming_both_ways_out():
    with pytest.raises(ImproperlyConfigured) as refused:
        _settings(DEBUG="false")
    assert "No model is configured" in str(refused.value)
    assert "GOOGLE_API_KEY" in str(refused.value) and "AGENT_MODEL=scripted" in str(refused.value)


def test_the_offline_model_in_production_is_explicit_and_plays_no_demo_script():
    read = _settings(DEBUG="false", AGENT_MODEL="scripted")
    assert (read.AGENT_MODEL, read.SCRIPTED_DEFAULT_SCRIPTS) == ("scripted", False)


def test_under_debug_the_demo_plays_as_before():
    read = _settings(DEBUG="true")
    assert (read.AGENT_MODEL, read.SCRIPTED_DEFAULT_SCRIPTS) == ("scripted", True)


# The run executes on ADK's own engine, which must see the run row committed.
@pytest.mark.django_db(transaction=True)
def test_a_run_without_a_script_is_refused_when_default_scripts_are_off(settings):
    settings.SCRIPTED_DEFAULT_SCRIPTS = False
    with pytest.raises(ValidationError) as refused:
        run_now(message="Jane asks about her refund.")
    assert "SCRIPTED_DEFAULT_SCRIPTS=true" in str(refused.value)
    assert not AgentRun.objects.exists()
    assert not OutboxEmail.objects.exists()
