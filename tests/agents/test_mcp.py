"""An agent whose tools come from a real MCP server (stdio), run under the ledger."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from runs.execution.executor import execute as execute_run
from runs.ledger import reconcile
from runs.models.ledger import AgentRun, RunStatus, ToolCall, ToolCallStatus
from runs.rules import replay
from tests.helpers import BASE_DIR, MCP_SERVER, child_env, package_source, run_now
from tests.kit import api_as

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

READ = {"call": "read_ticket", "args": {"ticket_id": "T-1"}}
CLOSE = {"call": "close_ticket", "args": {"ticket_id": "T-1", "note": "solved"}}


@pytest.fixture
def mcp_env(monkeypatch, tmp_path):
    store = tmp_path / "tickets.txt"
    monkeypatch.setenv("LEDGER_TEST_MCP_SERVER", str(MCP_SERVER))
    monkeypatch.setenv("LEDGER_TEST_MCP_STORE", str(store))
    monkeypatch.delenv("LEDGER_TEST_MCP_HANG", raising=False)
    return store


@pytest.fixture
def mcp_desk(agents_dir, mcp_env):
    return agents_dir(mcp_desk=package_source("mcp_desk"))["mcp_desk"]


def test_mcp_tools_are_listed_with_their_server_and_hints(mcp_desk, alice):

    assert mcp_desk.load_error == "" and mcp_desk.tool_errors == []
    command = f"{sys.executable} {MCP_SERVER}"
    tools = {tool.name: tool for tool in mcp_desk.tools}
    assert sorted(tools) == ["close_ticket", "read_ticket"]
    assert {tool.source for tool in tools.values()} == {"mcp"}
    assert tools["read_ticket"].detail == command
    assert tools["read_ticket"].annotations == {"readOnlyHint": True}
    assert tools["close_ticket"].annotations == {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": False}

    # alice may not configure agents: she sees the program and the script, not their folders.
    shown = f"{os.path.basename(sys.executable)} mcp_server.py"
    body = api_as(alice).get("/api/agents/mcp_desk/").json()
    assert {(t["name"], t["source"], t["detail"]) for t in body["tools"]} == {
        ("read_ticket", "mcp", shown), ("close_ticket", "mcp", shown),
    }
    reasons = {t["name"]: t["effect_reason"] for t in body["tools"]}
    assert reasons["read_ticket"] == "the server's readOnlyHint ignored: the server is not in MCP_TRUSTED_SERVERS"
    # What the server sent is said as sent: a false hint is not "no hint".
    assert reasons["close_ticket"] == "an MCP server's tool (readOnlyHint=false, idempotentHint=false): effectful, the default"


def test_an_mcp_agent_runs_under_the_ledger_with_its_calls_journaled(mcp_desk, mcp_env):
    run = run_now(agent_name="mcp_desk", message="Close T-1.", params={"script": [[READ, CLOSE], {"say": "Closed T-1."}]})

    assert run.status == RunStatus.SUCCESS, run.error_message
    calls = list(ToolCall.objects.filter(run=run).order_by("seq"))
    assert [(c.agent_name, c.tool_name, c.args, c.status) for c in calls] == [
        ("mcp_desk", "read_ticket", READ["args"], ToolCallStatus.ANSWERED),
        ("mcp_desk", "close_ticket", CLOSE["args"], ToolCallStatus.ANSWERED),
    ]
    assert "ticket T-1 closed" in calls[1].response_summary
    assert mcp_env.read_text() == "T-1 solved\n"  # the server really did it, once
    assert run.tools_executed == ["read_ticket", "close_ticket"]


def test_a_script_naming_a_tool_the_server_does_not_have_is_refused(mcp_desk, alice):

    response = api_as(alice).post(
        "/api/runs/", {"agent": "mcp_desk", "message": "x", "owner_id": "jane",
                       "params": {"script": [{"call": "delete_ticket", "args": {}}]}}, format="json",
    )
    assert response.status_code == 400
    assert "has no tool named 'delete_ticket' (it has close_ticket, read_ticket)" in response.json()["errors"]["params"][0]


def test_a_server_that_never_lists_its_tools_does_not_block_loading(agents_dir, monkeypatch, tmp_path, settings):
    silent = tmp_path / "silent_server.py"
    silent.write_text("import time\ntime.sleep(120)\n")  # holds stdio open and never answers
    monkeypatch.setenv("LEDGER_TEST_MCP_SERVER", str(silent))
    settings.AGENT_TOOL_LISTING_TIMEOUT_SECONDS = 2
    started = time.monotonic()
    spec = agents_dir(mcp_desk=package_source("mcp_desk"), desk=package_source("desk"))["mcp_desk"]
    assert time.monotonic() - started < 30
    [error] = spec.tool_errors
    assert error.startswith(f"mcp_desk: The MCP server {sys.executable} {silent}")
    assert "2 s" in error or "could not list" in error
    assert spec.load_error == ""
    assert "desk" in __import__("agents.registry", fromlist=["runnable_agents"]).runnable_agents()


def test_a_worker_killed_inside_an_mcp_tool_is_reconciled_and_never_repeats_it(mcp_desk, mcp_env, admin_user):
    # The child runs the agent; the MCP server does its effect, then keeps the call open.
    code = textwrap.dedent(f"""
        import django; django.setup()
        from runs.execution import executor
        from runs.services import run as services
        run = services.start_run(agent_name="mcp_desk", message="Close T-1.", owner_id="alice", enqueue=False,
                                 params={{"script": {json.dumps([READ, CLOSE, {"say": "Closed."}])}}})
        print(run.run_id, flush=True)
        executor.execute(run.run_id)
    """)
    env = child_env(
        AGENTS_DIR=",".join(django_settings.AGENTS_DIR),
        LEDGER_TEST_MCP_SERVER=str(MCP_SERVER),
        LEDGER_TEST_MCP_STORE=str(mcp_env),
        LEDGER_TEST_MCP_HANG="60",
    )
    child = subprocess.Popen([sys.executable, "-c", code], cwd=BASE_DIR, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        run_id = child.stdout.readline().strip()
        deadline = time.monotonic() + 60
        while not mcp_env.with_suffix(".pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mcp_env.read_text() == "T-1 solved\n", "the MCP tool never ran"
        os.kill(child.pid, signal.SIGKILL)  # the worker dies while the MCP tool is still running
        child.wait(timeout=30)
    finally:
        # The MCP server runs in a session of its own and is left waiting on its call: end it.
        pid_file = mcp_env.with_suffix(".pid")
        for pid in ([int(pid_file.read_text())] if pid_file.exists() else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert child.returncode == -signal.SIGKILL

    run = AgentRun.objects.get(pk=run_id)
    assert run.status == RunStatus.RUNNING
    journal = {c.tool_name: c.status for c in run.tool_calls.all()}
    assert journal == {"read_ticket": ToolCallStatus.ANSWERED, "close_ticket": ToolCallStatus.CALLED}

    stale = timezone.now() + timedelta(seconds=django_settings.RUN_STALE_AFTER_SECONDS + 1)
    reconcile.sweep(now=stale)
    assert execute_run(run_id) == "not claimed"
    run.refresh_from_db()
    assert (run.status, run.error_code) == (RunStatus.ERROR, "reconciled")
    assert run.tools_executed == ["read_ticket", "close_ticket"]
    assert run.tool_calls.get(tool_name="close_ticket").in_doubt
    # The MCP server is not trusted, so close_ticket is effectful: its unanswered call is in doubt.
    decision = replay.decide(run, force=False)
    assert decision.code == "calls_in_doubt"
    assert decision.refusal.context["tools"] == ["close_ticket"]
    assert mcp_env.read_text() == "T-1 solved\n"


HTTP_MCP_DESK = '''
from google.adk.agents import LlmAgent
from google.adk.tools.mcp_tool import McpToolset, StreamableHTTPConnectionParams

root_agent = LlmAgent(
    name="http_desk",
    model="gemini-2.5-flash",
    tools=[McpToolset(connection_params=StreamableHTTPConnectionParams(
        url="http://desk-user:hunter2-password@127.0.0.1:9/mcp/sk-live-4f2a?token=tok-77e1", timeout=2))],
)
'''


def test_an_mcp_servers_credentials_never_reach_the_logs(agents_dir, settings, caplog):
    settings.AGENT_TOOL_LISTING_TIMEOUT_SECONDS = 3
    with caplog.at_level("WARNING"):
        spec = agents_dir(http_desk=HTTP_MCP_DESK)["http_desk"]
    [error] = spec.tool_errors
    assert "hunter2-password" in error  # the desk that may configure agents reads it whole
    logged = caplog.text
    assert "http_desk" in logged and "127.0.0.1" in logged
    for secret in ("hunter2-password", "desk-user", "sk-live-4f2a", "tok-77e1"):
        assert secret not in logged, secret
