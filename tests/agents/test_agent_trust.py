"""Bringing a team's agent package must not change the deployment or show its secrets."""

from __future__ import annotations

import os

import pytest

from agents import registry
from tests.helpers import package_source, run_now
from tests.kit import api_as, login

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


    agents_dir(exits=EXITS_AT_IMPORT, desk=package_source("desk"))
    listed = api_as(alice).get("/api/agents/")
    assert listed.status_code == 200
    by_name = {agent["name"]: agent for agent in listed.json()}
    assert "SystemExit" in by_name["exits"]["load_error"]
    assert by_name["desk"]["load_error"] == ""


# --- ADK's control tools ------------------------------------------------------------------------------

HANDOFF = '''
from google.adk.agents import LlmAgent, LoopAgent
from google.adk.tools import exit_loop, load_memory

from agents.effects import read_only


@read_only
def read_ticket(ticket_id: str) -> dict:
    """Read a ticket."""
    return {"ticket_id": ticket_id, "text": "Refund order A-1."}


refunds = LlmAgent(name="refunds", model="gemini-2.5-flash", description="Issues refunds.")
looper = LoopAgent(name="looper", max_iterations=2, sub_agents=[
    LlmAgent(name="checker", model="gemini-2.5-flash", tools=[exit_loop, load_memory]),
])
root_agent = LlmAgent(name="handoff", model="gemini-2.5-flash", tools=[read_ticket], sub_agents=[refunds, looper])
'''

HANDOFF_SCRIPTS = {
    "handoff": [
        {"call": "read_ticket", "args": {"ticket_id": "T-1"}},
        {"call": "transfer_to_agent", "args": {"agent_name": "refunds"}},
    ],
    "refunds": [{"fail": "error", "message": "the model provider is down"}],
}


def test_adks_control_tools_are_read_only_with_their_reason(agents_dir):
    spec = agents_dir(handoff=HANDOFF)["handoff"]
    checker = spec.llm_agents["checker"]
    effects = {tool.name: (tool.effect, tool.effect_reason) for tool in checker.tools}
    assert effects["exit_loop"][0] == "read_only" and "LoopAgent" in effects["exit_loop"][1]
    assert effects["load_memory"][0] == "read_only" and "memory" in effects["load_memory"][1]

    from google.adk.tools.transfer_to_agent_tool import TransferToAgentTool

    from agents.effects import effect_of_call_name, effect_of_tool

    assert effect_of_tool(TransferToAgentTool(agent_names=["refunds"])).kind == "read_only"
    assert effect_of_call_name("adk_request_confirmation").kind == "read_only"
    assert effect_of_call_name("send_email") is None


# Runs execute on the executor's own thread and connection: the rows must be committed.
@pytest.mark.django_db(transaction=True)
def test_a_run_that_read_handed_over_and_hit_a_model_error_is_replayed_without_force(agents_dir, alice, admin_client):
    from runs.models.ledger import ToolCall
    from runs.services import run as services

    agents_dir(handoff=HANDOFF)
    run = run_now(agent_name="handoff", message="Refund T-1.", params={"scripts": HANDOFF_SCRIPTS}, created_by=alice)
    assert run.status == "error", run.result
    calls = list(ToolCall.objects.filter(run=run).order_by("seq").values_list("tool_name", "effect"))
    assert calls == [("read_ticket", "read_only"), ("transfer_to_agent", "read_only")]
    replay = services.replay_run(run.run_id, actor=alice)
    assert replay.replay_of_id == run.run_id
    # The run page's journal says why each call has its class.
    html = admin_client.get(f"/admin/runs/agentrun/{run.run_id}/change/").content.decode()
    assert "read_only — ADK&#x27;s hand-off between agents: it acts on nothing outside" in html
    assert "read_only — declared where the tool is written" in html


# --- What is shown of a tool's source, to whom --------------------------------------------------------

SECRET_MCP = '''
import os
import sys

from google.adk.agents import LlmAgent
from google.adk.tools.mcp_tool import McpToolset, StdioConnectionParams, StreamableHTTPConnectionParams
from mcp import StdioServerParameters

SERVER = os.environ["LEDGER_TEST_MCP_SERVER"]

root_agent = LlmAgent(
    name="secret_mcp",
    model="gemini-2.5-flash",
    tools=[
        McpToolset(connection_params=StdioConnectionParams(
            server_params=StdioServerParameters(
                command=sys.executable, args=[SERVER, "--api-key=sk-live-123"],
                env={**os.environ, "TICKETS_TOKEN": "tok-env-999"},
            ),
            timeout=20,
        )),
        McpToolset(connection_params=StreamableHTTPConnectionParams(
            url="http://bob:hunter2@127.0.0.1:9/mcp/k-path-secret?token=tok-url-abc", timeout=2,
        )),
    ],
)
'''
SECRETS = ("sk-live-123", "tok-env-999", "hunter2", "tok-url-abc", "k-path-secret", "bob:")


@pytest.fixture
def secret_mcp(agents_dir, monkeypatch, tmp_path):
    from tests.helpers import MCP_SERVER

    monkeypatch.setenv("LEDGER_TEST_MCP_SERVER", str(MCP_SERVER))
    monkeypatch.setenv("LEDGER_TEST_MCP_STORE", str(tmp_path / "tickets.txt"))
    monkeypatch.delenv("LEDGER_TEST_MCP_HANG", raising=False)
    return agents_dir(secret_mcp=SECRET_MCP, broken="import nowhere_to_be_found\n")


def _shown(text: str, tmp_path) -> None:
    for secret in SECRETS:
        assert secret not in text, secret
    assert str(tmp_path) not in text
    assert "/work/" not in text and "/usr/" not in text and "/.venv/" not in text


def test_mcp_sources_are_redacted_for_people_who_may_not_configure_agents(secret_mcp, alice, support_agent, tmp_path):


    listed = api_as(alice).get("/api/agents/")
    assert listed.status_code == 200
    _shown(listed.content.decode(), tmp_path)
    body = api_as(alice).get("/api/agents/secret_mcp/").json()
    details = {tool["detail"] for tool in body["tools"]}
    assert details == {f"{__import__('sys').executable.rsplit('/', 1)[-1]} mcp_server.py (1 argument hidden)"}
    assert body["tool_errors"] and "http://127.0.0.1:9/…" in body["tool_errors"][0]
    assert body["path"].endswith("/secret_mcp") and body["path"].startswith("…/")

    client = login(support_agent)
    page = client.get("/admin/agents-loaded/")
    assert page.status_code == 200
    html = page.content.decode()
    _shown(html, tmp_path)
    assert "Can configure agents" in html


def test_people_who_may_configure_agents_see_the_sources(secret_mcp, bare_staff, tmp_path):
    from django.contrib.auth.models import Permission



    bare_staff.user_permissions.add(Permission.objects.get(codename="configure_agents", content_type__app_label="agents"))
    staff = type(bare_staff).objects.get(pk=bare_staff.pk)
    body = api_as(staff).get("/api/agents/secret_mcp/").json()
    assert any("--api-key=sk-live-123" in tool["detail"] for tool in body["tools"])
    assert body["path"] == str(tmp_path / "agents" / "secret_mcp")
    # The environment is passed to the server, never shown, whoever asks.
    assert "tok-env-999" not in str(body)


# --- Faults on any tool, with the setting and a permission --------------------------------------------

REFUND = {"call": "issue_refund", "args": {"order_id": "A-1", "amount": 5}}


def _refunds_script(**fault) -> dict:
    return {"scripts": {"desk": [{"call": "transfer_to_agent", "args": {"agent_name": "refunds"}}],
                        "refunds": [dict(REFUND, **fault), {"say": "Refunded."}]}}


@pytest.fixture
def refund_log(agents_dir, tmp_path, monkeypatch):
    """The desk package with an issue_refund that writes each refund to a file: its effect, for real."""
    log = tmp_path / "refunds.log"
    monkeypatch.setenv("DESK_REFUND_LOG", str(log))
    source = package_source("desk").replace(
        '''    """Refund part of an order."""
''',
        '''    """Refund part of an order."""
    import os
    with open(os.environ["DESK_REFUND_LOG"], "a") as log:
        log.write(f"{order_id} {amount}\\n")
''',
    )
    assert "DESK_REFUND_LOG" in source
    agents_dir(desk=source)
    return log


# The executor runs the agent on its own thread and connection: rows must be committed.
@pytest.mark.django_db(transaction=True)
def test_tool_fails_on_a_packages_own_function_fails_after_its_effect(refund_log, settings, alice):
    from runs.models.ledger import ToolCall

    settings.SCRIPTED_FAULTS_ENABLED = True
    run = run_now(agent_name="desk", message="Refund A-1.", params=_refunds_script(tool_fails="the bank hung up"),
                  created_by=alice)
    assert (run.status, run.error_code) == ("error", "tool_failed"), run.error_message
    assert "the bank hung up" in run.error_message
    assert refund_log.read_text() == "A-1 5\n"
    call = ToolCall.objects.get(run=run, tool_name="issue_refund")
    assert call.status == "failed" and "the bank hung up" in call.response_summary


@pytest.mark.django_db(transaction=True)
def test_a_hang_on_a_packages_own_function_holds_the_call(refund_log, settings, alice):
    import time

    settings.SCRIPTED_FAULTS_ENABLED = True
    started = time.monotonic()
    run = run_now(agent_name="desk", message="Refund A-1.", params=_refunds_script(hang=1.5), created_by=alice)
    assert run.status == "success", run.error_message
    assert time.monotonic() - started >= 1.5


@pytest.mark.django_db(transaction=True)
def test_without_the_permission_faults_are_refused_and_never_honoured(refund_log, settings, alice, bob):

    from runs.refusals import FaultsNotPermitted
    from runs.services import run as services


    settings.SCRIPTED_FAULTS_ENABLED = True
    settings.SCRIPTS_FROM_USERS_ALLOWED = True
    refused = api_as(bob).post(
        "/api/runs/", {"agent": "desk", "message": "Refund", "owner_id": "bob",
                       "params": _refunds_script(crash="before_effect")}, format="json",
    )
    assert refused.status_code == 403, refused.content
    assert refused.json()["code"] == "faults_not_permitted"
    with pytest.raises(FaultsNotPermitted):
        services.start_run(agent_name="desk", message="x", owner_id="bob", params=_refunds_script(hang=1),
                           created_by=bob, enqueue=False)

    # A run that carries faults anyway (alice's run replayed by bob) plays without them.
    from runs.execution import executor

    run = services.start_run(agent_name="desk", message="Refund", owner_id="bob",
                             params=_refunds_script(tool_fails="never"), created_by=alice, enqueue=False)
    type(run).objects.filter(pk=run.pk).update(created_by=bob)
    executor.execute(run.run_id)
    run.refresh_from_db()
    assert run.status == "success", run.error_message
    assert refund_log.read_text() == "A-1 5\n"


# A real worker process, SIGKILLed by the fault; the test reads its rows from another connection.
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("point, refunded", [("before_effect", ""), ("after_effect", "A-1 5\n")])
def test_a_crash_on_a_packages_own_function_kills_the_worker_at_that_point(refund_log, settings, point, refunded):
    import json
    import signal
    import subprocess
    import sys
    import textwrap

    from runs.models.ledger import AgentRun, ToolCall
    from tests.helpers import BASE_DIR, child_env

    code = textwrap.dedent(f"""
        import django; django.setup()
        from runs.execution import executor
        from runs.services import run as services
        run = services.start_run(agent_name="desk", message="Refund A-1.", owner_id="alice", enqueue=False,
                                 params={json.dumps(_refunds_script(crash=point))})
        print(run.run_id, flush=True)
        executor.execute(run.run_id)
    """)
    env = child_env(AGENTS_DIR=",".join(settings.AGENTS_DIR), DESK_REFUND_LOG=str(refund_log))
    child = subprocess.run([sys.executable, "-c", code], cwd=BASE_DIR, env=env, capture_output=True, text=True,
                           timeout=180)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    run = AgentRun.objects.get(pk=child.stdout.split()[0])
    assert run.status == "running"  # for the reconciler: the worker died mid-call
    assert (refund_log.read_text() if refund_log.exists() else "") == refunded
    assert ToolCall.objects.get(run=run, tool_name="issue_refund").status == "called"


# --- Offline, an agent with nothing to play -------------------------------------------------------------

NO_SCRIPT = '''
from google.adk.agents import LlmAgent

root_agent = LlmAgent(name="quiet", model="gemini-2.5-flash", description="Has no script.")
'''


def test_an_offline_agent_with_no_script_is_refused_with_a_400(agents_dir, alice, settings):
    from runs.models.ledger import AgentRun


    settings.SCRIPTS_FROM_USERS_ALLOWED = True
    agents_dir(quiet=NO_SCRIPT)
    refused = api_as(alice).post("/api/runs/", {"agent": "quiet", "message": "Hello", "owner_id": "jane"},
                                     format="json")
    assert refused.status_code == 400, refused.content
    assert "has no script to play" in refused.json()["errors"]["params"][0]
    assert "DEFAULT_SCRIPT" in refused.json()["errors"]["params"][0]
    assert not AgentRun.objects.exists()

    given = api_as(alice).post(
        "/api/runs/", {"agent": "quiet", "message": "Hello", "owner_id": "jane",
                       "params": {"script": [{"say": "Hello."}]}}, format="json",
    )
    assert given.status_code == 202, given.content


# --- Start-up, and MCP answers ------------------------------------------------------------------------------


def test_the_start_up_list_shows_each_agent_of_the_tree_with_its_tools(agents_dir):
    from io import StringIO

    from runs.management.commands.serve import Command

    agents_dir(desk=package_source("desk"), exits=EXITS_AT_IMPORT)
    out, err = StringIO(), StringIO()
    command = Command(stdout=out, stderr=err)
    command.report_agents()
    line = next(line for line in out.getvalue().splitlines() if line.startswith("Agent desk:"))
    assert "desk: lookup_order, summarizer" in line
    assert "refunds: lookup_order, issue_refund" in line and "carrier_check: check_carrier" in line
    assert "Agent exits could not be loaded: SystemExit" in err.getvalue()


def test_an_mcp_answer_is_journaled_as_the_value_it_carries():
    import json

    from runs.ledger.journal import journal_rows

    run_id = "5f0c5a4e-0000-4000-8000-000000000001"

    def answer(payload: dict) -> str:
        event = {"custom_metadata": {"run_id": run_id}, "content": {"parts": [
            {"function_response": {"id": "c1", "name": "read_ticket", "response": payload}}]}}
        return journal_rows(event)[2][0]["summary"]

    structured = {"content": [{"type": "text", "text": '{"ticket": "T-1", "state": "open"}'}],
                  "structuredContent": {"ticket": "T-1", "state": "open"}, "isError": False}
    assert json.loads(answer(structured)) == {"ticket": "T-1", "state": "open"}
    text_json = {"content": [{"type": "text", "text": '{"ticket": "T-1"}'}], "isError": False}
    assert json.loads(answer(text_json)) == {"ticket": "T-1"}
    assert json.loads(answer({"content": [{"type": "text", "text": "no such ticket"}], "isError": True})) == {
        "error": "no such ticket"}
    # Anything else is kept as the tool answered.
    assert json.loads(answer({"content": "mine", "status": "ok"})) == {"content": "mine", "status": "ok"}
