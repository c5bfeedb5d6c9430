"""Approvals against real process deaths, on PostgreSQL (docs/architecture.md, "Approvals and tools that wait").

A waiting run belongs to no process: the worker that parked it and the web that showed it can die
and be started again, and the run still waits, then goes on once when approved. After a decision
the approved call is an ordinary call of the run: a worker killed at any point of the attempt that
runs it (before the answers reach ADK, before the tool, inside it before or after its effect,
after its response) never refunds twice — the system continues what needs nobody, and a person
settles a call left in doubt, as for any call (tests/processes/test_crash_matrix.py plays the same world).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone
from rest_framework.authtoken.models import Token

from agents.models import Refund
from runs.execution.executor import execute as execute_run
from runs.ledger import reconcile
from runs.management.commands.serve import web_command
from runs.models.approvals import Decision, PendingCall
from runs.models.ledger import AgentRun, RunStatus
from runs.services import decisions
from runs.services import run as services
from runs.upkeep import recovery
from tests.chat.test_chat import _free_port
from tests.helpers import BASE_DIR, child_env, postgres_only, run_python, wait_until, wait_until_serving
from tests.services.test_approvals import BIG_REFUND, REFUNDED, approver, waiting_refund  # noqa: F401 - fixture

pytestmark = [pytest.mark.slow, postgres_only, pytest.mark.django_db(transaction=True)]


# --- A web and a worker, killed and started again while the run waits ---------------------------------


def _start_web(log_path: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    with open(log_path, "ab") as log:
        web = subprocess.Popen(web_command(host="127.0.0.1", port=port), cwd=BASE_DIR,
                               env=child_env(LOG_LEVEL="WARNING"), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(url, web, log_path)
    return web, url


def _start_cluster(log_path: Path) -> subprocess.Popen:
    """The worker processes (`runworker`, one process)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "manage.py", "runworker", "--processes", "1"], cwd=BASE_DIR,
                                env=child_env(RUN_POLL_SECONDS="0.5", LOG_LEVEL="WARNING"),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _sigkill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        _sigkill(process)
    connection.close()


def test_a_run_waits_through_a_killed_worker_and_a_restarted_web_then_goes_on_once(
        alice, approver, processes, tmp_path):  # noqa: F811
    log = tmp_path / "processes.log"
    alice_key, approver_key = (Token.objects.create(user=user).key for user in (alice, approver))
    web, url = _start_web(log)
    cluster = _start_cluster(log)
    processes += [web, cluster]

    started = httpx.post(f"{url}/api/runs/", headers={"Authorization": f"Token {alice_key}"}, timeout=30, json={
        "agent": "support", "message": "Refund order A-1001.", "owner_id": "jane",
        "params": {"script": [BIG_REFUND, REFUNDED]}})
    assert started.status_code == 202, started.text
    run_id = started.json()["run_id"]
    wait_until(lambda: AgentRun.objects.get(pk=run_id).status == RunStatus.WAITING, timeout=120,
               what=f"the run to wait (log: {log})")

    # Every process that knew the run dies; new ones start, and a sweep runs long after.
    _sigkill(cluster)
    _sigkill(web)
    web, url = _start_web(log)
    cluster = _start_cluster(log)
    processes += [web, cluster]
    reconcile.sweep(now=timezone.now() + timedelta(hours=1))
    run = AgentRun.objects.get(pk=run_id)
    assert (run.status, run.attempts, run.heartbeat_at) == (RunStatus.WAITING, 1, None)
    assert Refund.objects.count() == 0

    shown = httpx.get(f"{url}/api/runs/{run_id}/", headers={"Authorization": f"Token {approver_key}"}, timeout=30)
    (pending,) = shown.json()["pending_calls"]
    assert (shown.json()["status"], pending["tool_name"], pending["args"]) == ("waiting", "issue_refund",
                                                                              BIG_REFUND["args"])
    decided = httpx.post(f"{url}/api/runs/{run_id}/calls/{pending['call_id']}/decision/", timeout=30,
                         headers={"Authorization": f"Token {approver_key}"},
                         json={"decision": "approve", "note": "Checked after the restart."})
    assert decided.status_code == 202, decided.text

    wait_until(lambda: AgentRun.objects.get(pk=run_id).status == RunStatus.SUCCESS, timeout=120,
               what=f"the new worker to finish the approved run (log: {log})")
    run = AgentRun.objects.get(pk=run_id)
    assert (run.attempts, run.result) == (2, REFUNDED["say"])
    assert execute_run(run_id) == "not claimed"
    (refund,) = Refund.objects.all()
    assert (refund.run_id, refund.call_id) == (run.run_id, pending["call_id"])


# --- The approved call's effect, once, whatever kills the attempt that runs it ------------------------

_PRELUDE = """
import os, signal
from runs.execution.executor import execute as execute_run
KILL = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
"""

KILL_POINTS: dict[str, dict] = {
    "after the claim, before the answers reach ADK": {"hook": """
from runs.ledger import approvals
approvals.mark_delivered = KILL
""", "effect": False},
    "after the answers are delivered, before the tool starts": {"hook": """
from runs.ledger.journal import JournalPlugin
async def die(self, *, tool, tool_args, tool_context):
    KILL()
JournalPlugin.before_tool_callback = die
""", "effect": False},
    "inside the tool, before its effect": {"crash": "before_effect", "effect": False},
    "inside the tool, after its effect": {"crash": "after_effect", "effect": True},
    "after the tool's response, before the next model call": {"hook": """
from agents.scripted import ScriptedLlm
async def die(self, llm_request, stream=False):
    KILL()
    yield  # pragma: no cover
ScriptedLlm.generate_content_async = die
""", "effect": True},
}


def _chain(run_id) -> list[AgentRun]:
    chain = [AgentRun.objects.get(pk=run_id)]
    while (nxt := AgentRun.objects.filter(resume_of=chain[-1]).first()) is not None:
        chain.append(nxt)
    return chain


def _past_the_stale_window():
    return timezone.now() + timedelta(
        seconds=settings.RUN_STALE_AFTER_SECONDS + 1)


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_the_approved_calls_effect_happens_once_when_its_worker_is_killed(point, alice, approver, admin_user,  # noqa: F811
                                                                           settings):
    settings.RUN_RECOVERY = "resume"
    spec = KILL_POINTS[point]
    run, pending = waiting_refund(alice)
    if "crash" in spec:
        # The fault belongs to the approved call's step; this process asked and must not die.
        AgentRun.objects.filter(pk=run.pk).update(config={**run.config, "params": {"script": [
            dict(BIG_REFUND, crash=spec["crash"]), REFUNDED]}})
    decisions.decide_call(run_id=run.run_id, call_id=pending.call_id, actor=approver, decision="approve")

    worker = run_python(textwrap.dedent(_PRELUDE) + textwrap.dedent(spec.get("hook", "")) +
                        f"\nexecute_run({json.dumps(str(run.run_id))})\n")
    assert worker.returncode == -signal.SIGKILL, f"{point}: the worker did not die\n{worker.stderr[-3000:]}"
    assert Refund.objects.count() == int(spec["effect"]), "the kill did not land where the point says"
    pending.refresh_from_db()
    assert pending.decision == Decision.APPROVE  # the decision stands, whatever became of its attempt

    for _ in range(settings.RUN_RECOVERY_ATTEMPTS + 2):
        # The world goes on: the sweep with its recovery, and django-q2 delivering what was enqueued.
        reconcile.sweep(now=_past_the_stale_window())
        recovery.recover_due(now=_past_the_stale_window())
        end = _chain(run.run_id)[-1]
        if end.status == RunStatus.QUEUED:
            execute_run(str(end.run_id))
            end.refresh_from_db()
        if end.status == RunStatus.SUCCESS:
            break
        if end.status == RunStatus.WAITING:
            # A call settled "not done" is told to the model, which calls again: a new call, asked anew.
            for asked in end.pending_calls.filter(decision=""):
                assert asked.call_id != pending.call_id and asked.args == BIG_REFUND["args"], point
                decisions.decide_call(run_id=end.run_id, call_id=asked.call_id, actor=approver, decision="approve")
            # This time nothing kills the worker (it is this process): the call's scripted fault is gone.
            AgentRun.objects.filter(pk=end.pk).update(config={**end.config, "params": {"script": [
                BIG_REFUND, REFUNDED]}})
            execute_run(str(end.run_id))
            continue
        # Left for a person, for the reason it gives: the call may have acted.
        assert end.recovery == "needs_person" and "doubt" in end.recovery_detail, (
            point, end.status, end.error_code, end.recovery_detail)
        refunds = Refund.objects.count()
        call = end.tool_calls.filter(tool_name="issue_refund", settled_outcome="").first()
        if call is not None:
            decisions.settle_call(run_id=end.run_id, call_id=call.call_id, actor=admin_user,
                                outcome="done" if refunds else "not_done", note=f"The bank shows {refunds} refund(s).")
        continued = services.resume_run(end.run_id, actor=admin_user)
        execute_run(str(continued.run_id))
    chain = _chain(run.run_id)
    assert chain[-1].status == RunStatus.SUCCESS, [(r.status, r.error_code, r.recovery_detail) for r in chain]
    assert Refund.objects.count() == 1, f"{point}: {Refund.objects.count()} refunds"
    assert not PendingCall.objects.filter(decision="").exists()
