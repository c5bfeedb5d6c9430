"""Bringing a team's agent package must not change the deployment or show its secrets."""

from __future__ import annotations

import os

import pytest

from agents import registry
from tests.helpers import package_source, run_now

pytestmark = pytest.mark.django_db

EXITS_AT_IMPORT = "import sys\n\nsys.exit(3)\n"
INTERRUPTS_AT_IMPORT = "raise KeyboardInterrupt\n"


# --- A package's .env ------------------------------------------------------------------------------


@pytest.fixture
def planted_dotenv(agents_dir, tmp_path, monkeypatch):
    """A `.env` above the agents folder, as anyone who may write there could plant it."""
    (tmp_path / ".env").write_text("AL_PLANTED=yes\nSCRIPTED_FAULTS_ENABLED=true\n")
    monkeypatch.delenv("AL_PLANTED", raising=False)
    monkeypatch.delenv("ADK_DISABLE_LOAD_DOTENV", raising=False)
    yield agents_dir
    os.environ.pop("AL_PLANTED", None)


def test_a_dotenv_above_the_packages_is_not_loaded_by_default(planted_dotenv, settings):
    assert settings.AGENTS_LOAD_DOTENV is False
    specs = planted_dotenv(desk=package_source("desk"))
    assert specs["desk"].load_error == ""
    assert "AL_PLANTED" not in os.environ
    # The switch that stops ADK's loader is put back as it was.
    assert "ADK_DISABLE_LOAD_DOTENV" not in os.environ


def test_a_dotenv_is_loaded_when_the_deployment_asks_for_it(planted_dotenv, settings):
    settings.AGENTS_LOAD_DOTENV = True
    planted_dotenv(desk=package_source("desk"))
    assert os.environ.get("AL_PLANTED") == "yes"


# --- Anything raised at import ----------------------------------------------------------------------


# The executor's session store runs the model loop on a thread of its own connection.
@pytest.mark.django_db(transaction=True)
def test_a_package_that_exits_at_import_is_a_load_error_and_the_others_run(agents_dir):
    specs = agents_dir(exits=EXITS_AT_IMPORT, interrupts=INTERRUPTS_AT_IMPORT, desk=package_source("desk"))
    assert "SystemExit" in specs["exits"].load_error and "sys.exit(3)" in specs["exits"].load_error
    assert "KeyboardInterrupt" in specs["interrupts"].load_error
    assert {"exits", "interrupts"}.isdisjoint(registry.runnable_agents())
    run = run_now(agent_name="desk", message="Where is A-1?")
    assert run.status == "success", run.error_message


def test_the_api_lists_a_package_that_exits_at_import_with_the_others(agents_dir, alice):
    from tests.test_agents_dir import api_client

    agents_dir(exits=EXITS_AT_IMPORT, desk=package_source("desk"))
    listed = api_client(alice).get("/api/agents/")
    assert listed.status_code == 200
    by_name = {agent["name"]: agent for agent in listed.json()}
    assert "SystemExit" in by_name["exits"]["load_error"]
    assert by_name["desk"]["load_error"] == ""
