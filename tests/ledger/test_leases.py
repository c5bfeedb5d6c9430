"""Leases: a run's writes belong to the attempt that holds it (docs/architecture.md, "Leases").

First each fenced write on its own (the event append and so the journal, the effect record, the
settle, workflow steps, the heartbeat), then the worker that was not dead: a real worker process
paused (SIGSTOP) past RUN_STALE_AFTER_SECONDS while its run waits on the model between a read-only
call and an effectful one, reconciled and done again elsewhere, then let go on (SIGCONT).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone
from google.adk.events.event import Event
from google.genai import types

from agents.adk import run_coroutine, session_service
from agents.models import AdkEvent
from runs.execution import executor
from runs.execution.heartbeat import ProcessHeartbeat
from runs.ledger import effects, leases, lifecycle, reconcile, steps
from runs.ledger.counters import LEASE_REFUSALS
from runs.models.effects import ToolEffect
from runs.models.ledger import AgentRun, RunStatus, RunStep, ToolCall
from runs.rules import replay
from runs.services import run as services
from tests.factories import make_run
from tests.helpers import BASE_DIR, child_env, pid_of_worker, postgres_only, stop_cluster, wait_until

# ADK's engine writes the events on a connection of its own: the run row must be committed.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed


def _claimed() -> AgentRun:
    run = make_run(status=RunStatus.QUEUED)
    return lifecycle.claim_and_load_run(run_id=run.run_id, worker="host:1")


def _reconciled(run: AgentRun) -> None:
    """The run is settled by someone else, as a reconciler that thought its worker dead does."""
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.ERROR, error_code=reconcile.RECONCILED)


def _call_event(run: AgentRun, call_id: str) -> Event:
    return Event(
        invocation_id=run.invocation_id,
        author="support",
        custom_metadata=executor.run_metadata(run),
        content=types.Content(
            role="model", parts=[types.Part(function_call=types.FunctionCall(id=call_id, name="send_email", args={}))]
        ),
    )


def _refusals(write: str) -> float:
    return LEASE_REFUSALS.labels(write=write)._value.get()


def test_each_claim_holds_the_run_under_a_fresh_lease():
    run = _claimed()
    assert run.lease is not None
    other = _claimed()
    assert other.lease != run.lease


@committed
def test_an_event_of_a_run_no_longer_held_is_not_stored_and_its_call_never_journaled():
    run = _claimed()
    before = _refusals("a function call's event")

    async def scenario() -> None:
        sessions = session_service()
        session = await sessions.create_session(app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id)
        await sessions.append_event(session, _call_event(run, "held"))
        await sync_to_async(_reconciled)(run)
        with pytest.raises(leases.LeaseLost):
            await sessions.append_event(session, _call_event(run, "zombie"))

    run_coroutine(scenario())
    assert list(ToolCall.objects.filter(run=run).values_list("call_id", flat=True)) == ["held"]
    assert AdkEvent.objects.filter(session_id=run.session_id).count() == 1
    assert _refusals("a function call's event") == before + 1


@committed
def test_an_event_without_a_lease_is_stored_as_before():
    """Events of sessions the ledger does not run (`adk web` on the same database) are not fenced."""
    run = _claimed()
    _reconciled(run)

    async def scenario() -> None:
        sessions = session_service()
        session = await sessions.create_session(app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id)
        event = _call_event(run, "unfenced")
        event.custom_metadata = {}
        await sessions.append_event(session, event)

    run_coroutine(scenario())
    assert AdkEvent.objects.filter(session_id=run.session_id).count() == 1


def test_an_effect_record_is_not_started_for_a_run_no_longer_held():
    run = _claimed()
    _reconciled(run)
    with pytest.raises(leases.LeaseLost):
        effects.claim_effect(
            run_id=run.run_id, call_id="c1", intent=f"run:{run.run_id}", tool="send_email",
            business_key="jane@example.com", stable_fields={}, lease=run.lease,
        )
    assert not ToolEffect.objects.exists()


def test_an_effect_record_is_started_while_the_run_is_held():
    run = _claimed()
    claim = effects.claim_effect(
        run_id=run.run_id, call_id="c1", intent=f"run:{run.run_id}", tool="send_email",
        business_key="jane@example.com", stable_fields={}, lease=run.lease,
    )
    assert claim.kind == "run"
    # The tool answered after the run was taken from this worker: the record stays in doubt.
    _reconciled(run)
    with pytest.raises(leases.LeaseLost):
        effects.finish_effect(key=claim.key, run_id=run.run_id, call_id="c1", result={"ok": True}, lease=run.lease)
    assert ToolEffect.objects.get().status == "started"


@postgres_only
def test_a_new_key_is_claimed_in_one_statement_with_its_journal_row_and_a_repeat_reads_the_record():
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    run = _claimed()
    ToolCall.objects.create(run=run, seq=1, call_id="c1", tool_name="send_email")
    ToolCall.objects.create(run=run, seq=2, call_id="c2", tool_name="send_email")
    claim_args = dict(intent=f"run:{run.run_id}", tool="send_email", business_key="jane@example.com",
                      stable_fields={"subject": "Refund"}, lease=run.lease)
    with CaptureQueriesContext(connection) as first:
        claim = effects.claim_effect(run_id=run.run_id, call_id="c1", **claim_args)
    assert claim.kind == "run"
    assert len(first.captured_queries) == 1, [q["sql"] for q in first.captured_queries]
    record = ToolEffect.objects.get()
    assert (record.key, record.status, record.first_run_id, record.first_call_id, record.business_key,
            record.stable_fields, record.result, record.error) == (
        claim.key, "started", run.run_id, "c1", "jane@example.com", {"subject": "Refund"}, None, "")
    assert ToolCall.objects.get(call_id="c1").effect_key == claim.key

    # The same key again, from another call of the same run: the record is read, not overwritten.
    repeat = effects.claim_effect(run_id=run.run_id, call_id="c2", **claim_args)
    assert repeat.kind == "in_doubt"
    assert ToolEffect.objects.get().first_call_id == "c1"
    assert ToolCall.objects.get(call_id="c2").status == "failed"


def test_the_settle_of_an_attempt_that_lost_its_lease_writes_nothing():
    run = _claimed()
    AgentRun.objects.filter(pk=run.pk).update(lease=leases.new_lease())  # another attempt holds it now
    assert lifecycle.settle_run(run_id=run.run_id, status=RunStatus.SUCCESS, result="late", run=run) is False
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.result, row.late_outcome) == (RunStatus.RUNNING, "", None)


def test_a_workflow_step_of_a_run_no_longer_held_is_refused():
    run = _claimed()
    steps.step_started(run_id=run.run_id, seq=1, node_path="wf/a", step_name="a", kind="agent", target="x",
                       lease=run.lease)
    _reconciled(run)
    with pytest.raises(leases.LeaseLost):
        steps.step_started(run_id=run.run_id, seq=2, node_path="wf/b", step_name="b", kind="agent", target="x",
                           lease=run.lease)
    with pytest.raises(leases.LeaseLost):
        steps.step_ended(run_id=run.run_id, node_path="wf/a", status="success", output="x", lease=run.lease)
    assert list(RunStep.objects.filter(run=run).values_list("node_path", "status")) == [("wf/a", "running")]


class _Control:
    def __init__(self, run: AgentRun):
        self.run_id, self.lease = run.run_id, run.lease
        self.started_monotonic = time.monotonic()
        self.cancelled_by_request = False
        self.aborted: list[str] = []

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)


def test_the_heartbeat_refreshes_only_runs_it_holds_and_aborts_the_others():
    held, reconciled, taken = _claimed(), _claimed(), _claimed()
    _reconciled(reconciled)
    AgentRun.objects.filter(pk=taken.pk).update(lease=leases.new_lease())
    old = timezone.now() - timedelta(minutes=5)
    AgentRun.objects.filter(pk__in=[held.pk, taken.pk]).update(heartbeat_at=old)
    controls = [_Control(run) for run in (held, reconciled, taken)]

    ProcessHeartbeat.beat_once(controls)

    assert [control.aborted for control in controls] == [[], [leases.LEASE_LOST], [leases.LEASE_LOST]]
    assert AgentRun.objects.get(pk=held.pk).heartbeat_at > old
    assert AgentRun.objects.get(pk=taken.pk).heartbeat_at == old  # not refreshed for a lease it lost


def test_a_refused_write_aborts_its_run_in_the_process_at_once():
    run = _claimed()
    control = _Control(run)
    heartbeat = ProcessHeartbeat()
    heartbeat._runs[run.run_id] = control
    leases.abort_refused_runs_with(heartbeat.lose)
    try:
        _reconciled(run)
        with pytest.raises(leases.LeaseLost):
            effects.record_effect_class(run_id=run.run_id, call_id="c1", effect="effectful", lease=run.lease)
    finally:
        from runs.execution.heartbeat import process_heartbeat

        leases.abort_refused_runs_with(lambda run_id: process_heartbeat().lose(run_id))
    assert control.aborted == [leases.LEASE_LOST]


# --- The worker that was not dead (real processes, PostgreSQL) ---------------------------------------

TEAM_PACKAGE = """
import os

from google.adk.agents import LlmAgent

from agents.effects import idempotent, read_only


@read_only
def peek(topic: str) -> dict:
    \"\"\"Reads the team's board.\"\"\"
    return {"topic": topic, "open": 2}


def _notify(channel: str, text: str) -> dict:
    with open(os.environ["TEAM_NOTIFICATIONS"], "a") as out:
        out.write(channel + " " + text + "\\n")
    return {"sent": True}


def notify(channel: str, text: str) -> dict:
    \"\"\"Posts to the team's channel (no idempotency key: effectful).\"\"\"
    return _notify(channel, text)


@idempotent(key="channel")
def notify_once(channel: str, text: str) -> dict:
    \"\"\"Posts to the team's channel, once per channel and intent.\"\"\"
    return _notify(channel, text)


root_agent = LlmAgent(name="team", model="gemini-2.5-flash", description="The team's notifier.",
                      tools=[peek, notify, notify_once])
"""


def _worker(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "manage.py", "runworker", "--processes", "1"], cwd=BASE_DIR, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )


def _worker_pid() -> int:
    """The worker process that claimed the run (its pid is in `worker`)."""
    run = wait_until(lambda: AgentRun.objects.filter(status=RunStatus.RUNNING).first(), timeout=60,
                     what="the worker to claim the run")
    return pid_of_worker(run.worker)


@postgres_only
@pytest.mark.parametrize("tool", ["notify", "notify_once"])
@committed
def test_a_paused_worker_woken_after_its_run_was_done_again_does_nothing_more(tool, agents_dir, tmp_path, support_agent):
    agents_dir(team=TEAM_PACKAGE)
    notifications = tmp_path / "notifications.txt"
    notifications.touch()
    env = child_env(
        AGENTS_DIR=",".join(settings.AGENTS_DIR),
        TEAM_NOTIFICATIONS=str(notifications), RUN_POLL_SECONDS="0.5", RUN_RECOVERY="off",
    )
    os.environ["TEAM_NOTIFICATIONS"] = str(notifications)
    script = [
        {"call": "peek", "args": {"topic": "deploys"}},
        # The model takes its time before the effectful call: the worker is paused meanwhile.
        {"call": tool, "args": {"channel": "#ops", "text": "deploy done"}, "latency": 3},
        {"say": "Posted."},
    ]
    cluster = _worker(env)
    try:
        run = services.start_run(agent_name="team", message="Tell #ops the deploy is done.", owner_id="ops",
                                 params={"script": script})
        worker_pid = _worker_pid()
        wait_until(lambda: ToolCall.objects.filter(run=run, tool_name="peek", status="answered").exists(),
                   timeout=60, what="the read-only call to be answered")
        os.kill(worker_pid, signal.SIGSTOP)
        try:
            # Past the stale window, as far as the rest of the world can tell the worker is dead.
            reconciled = reconcile.reconcile_stale_runs(
                now=timezone.now() + timedelta(seconds=settings.RUN_STALE_AFTER_SECONDS + 1)
            )
            assert [r.run_id for r in reconciled] == [run.run_id]
            run.refresh_from_db()
            assert run.tools_executed == ["peek"]
            # Only read-only calls were recorded: a replay without force is allowed, and does the work.
            assert replay.decide(run, force=False).allowed
            again = services.replay_run(run_id=run.run_id, actor=support_agent)
            executor.execute(again.run_id)
            again.refresh_from_db()
            assert again.status == RunStatus.SUCCESS, again.error_message
            assert notifications.read_text().count("#ops") == 1
        finally:
            os.kill(worker_pid, signal.SIGCONT)

        # The woken worker's model answers with the effectful call: its event is refused, the
        # tool never starts, and nothing more is written for the run.
        time.sleep(3 + 2 * settings.RUN_HEARTBEAT_SECONDS + 2)
        assert notifications.read_text().count("#ops") == 1
        run.refresh_from_db()
        assert (run.status, run.error_code, run.tools_executed, run.late_outcome) == (
            RunStatus.ERROR, reconcile.RECONCILED, ["peek"], None
        )
        assert list(ToolCall.objects.filter(run=run).values_list("tool_name", flat=True)) == ["peek"]

        # And it goes on serving.
        after = services.start_run(agent_name="team", message="Peek.", owner_id="ops",
                                   params={"script": [{"call": "peek", "args": {"topic": "x"}}, {"say": "ok"}]})
        wait_until(lambda: AgentRun.objects.filter(pk=after.pk, status=RunStatus.SUCCESS).exists(), timeout=60,
                   what="the woken worker to run the next run")
    finally:
        stop_cluster(cluster)
        os.environ.pop("TEAM_NOTIFICATIONS", None)
