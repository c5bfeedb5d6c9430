"""Production never plays the demo: without DEBUG the offline model is used only when asked for,
and then only with the scripts a run brings."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.core.exceptions import ValidationError

from agents.models import OutboxEmail
from runs.models import AgentRun
from tests.helpers import BASE_DIR, child_env, run_now

PRINT = "from django.conf import settings; print(settings.AGENT_MODEL, settings.SCRIPTED_DEFAULT_SCRIPTS)"


def _settings(*, drop: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
    environment = child_env(**env)
    for name in ("AGENT_MODEL", "GOOGLE_API_KEY", "SCRIPTED_DEFAULT_SCRIPTS", *drop):
        environment.pop(name, None)
    environment.update(env)
    return subprocess.run([sys.executable, "-c", "import django; django.setup()\n" + PRINT], cwd=BASE_DIR,
                          env=environment, capture_output=True, text=True, timeout=60, check=False)


def test_production_without_a_model_refuses_to_start_naming_both_ways_out():
    result = _settings(DEBUG="false")
    assert result.returncode != 0
    assert "No model is configured" in result.stderr
    assert "GOOGLE_API_KEY" in result.stderr and "AGENT_MODEL=scripted" in result.stderr


def test_the_offline_model_in_production_is_explicit_and_plays_no_demo_script():
    result = _settings(DEBUG="false", AGENT_MODEL="scripted")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["scripted", "False"]


def test_under_debug_the_demo_plays_as_before():
    result = _settings(DEBUG="true")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["scripted", "True"]


# The run executes on ADK's own engine, which must see the run row committed.
@pytest.mark.django_db(transaction=True)
def test_a_run_without_a_script_is_refused_when_default_scripts_are_off(settings):
    settings.SCRIPTED_DEFAULT_SCRIPTS = False
    with pytest.raises(ValidationError) as refused:
        run_now(message="Jane asks about her refund.")
    assert "SCRIPTED_DEFAULT_SCRIPTS=true" in str(refused.value)
    assert not AgentRun.objects.exists()
    assert not OutboxEmail.objects.exists()
