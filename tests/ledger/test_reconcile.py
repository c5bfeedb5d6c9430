"""Runs that die without saying goodbye: reconciliation on read, in bulk and from every door."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import DatabaseError
from django.urls import reverse
from django.utils import timezone

from runs.ledger import journal, lifecycle, reconcile
from runs.models.ledger import AgentRun, RunStatus, ToolCall, ToolCallStatus
from runs.services import run as services
from runs.tasks import reconcile_runs as reconcile_job
from tests.helpers import (
    BASE_DIR,
    LOOKUP,
    SAY_DONE,
    SEND_EMAIL,
    UPDATE_CRM,
    child_env,
    postgres_only,
    run_manage,
    run_now,
    script_params,
    wait_until,
)

# Runs on the agent loop, reconcilers in threads and worker processes read what the test committed.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed


def _running(*, heartbeat_age: timedelta | None = timedelta(seconds=0), started_age: timedelta = timedelta(0),
             owner_id: str = "alice") -> AgentRun:
    """A run a worker claimed, with its heartbeat (or its silence) set back in time."""
    run = services.start_run(agent_name="support", message="Refund Jane", owner_id=owner_id, enqueue=False)
    assert lifecycle.claim_run(run_id=run.run_id, worker="host:4242")
    now = timezone.now()
    AgentRun.objects.filter(pk=run.run_id).update(
        started_at=now - started_age,
        heartbeat_at=None if heartbeat_age is None else now - heartbeat_age,
    )
    run.refresh_from_db()
    return run


def _journal(run: AgentRun, *calls: tuple[str, str]) -> None:
    for seq, (name, status) in enumerate(calls, start=1):
        ToolCall.objects.create(run=run, seq=seq, call_id=f"call-{seq}", tool_name=name, status=status)


# --- The rule -------------------------------------------------------------------------------------


def test_a_silent_heartbeat_is_reconciled_with_a_message_a_person_can_act_on(settings):
    settings.RUN_STALE_AFTER_SECONDS = 60
    run = _running(heartbeat_age=timedelta(seconds=95))
    _journal(run, ("lookup_customer", ToolCallStatus.ANSWERED), ("send_email", ToolCallStatus.CALLED))

    landed = reconcile.reconcile_stale_runs()

    assert [r.run_id for r in landed] == [run.run_id]
    run.refresh_from_db()
    assert run.status == RunStatus.ERROR
    assert run.error_code == "reconciled"
    assert f"{run.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC" in run.error_message
    assert "last heard from" in run.error_message
    assert "No completion was recorded" in run.error_message
    assert "actual outcome is unknown" in run.error_message
    assert "host:4242" in run.error_message
    # The in-doubt send_email (called, never answered) counts as called.
    assert run.tools_executed == ["lookup_customer", "send_email"]
    assert run.finished_at is not None


def test_a_run_that_never_sent_a_heartbeat_is_reconciled_only_after_the_silence_limit(settings):
    settings.RUN_MAX_SILENCE_HOURS = 6
    quiet_for_long = _running(heartbeat_age=None, started_age=timedelta(hours=7))
    quiet_for_a_while = _running(heartbeat_age=None, started_age=timedelta(hours=5))

    landed = {r.run_id for r in reconcile.reconcile_stale_runs()}

    assert landed == {quiet_for_long.run_id}
    quiet_for_long.refresh_from_db()
    quiet_for_a_while.refresh_from_db()
    assert quiet_for_long.error_code == "reconciled"
    assert "never sent a heartbeat" in quiet_for_long.error_message
    assert quiet_for_a_while.status == RunStatus.RUNNING


@committed
def test_live_and_settled_runs_are_never_touched(settings):
    settings.RUN_STALE_AFTER_SECONDS = 60
    live = _running(heartbeat_age=timedelta(seconds=5))
    settled = run_now(params=script_params(SAY_DONE))
    AgentRun.objects.filter(pk=settled.run_id).update(heartbeat_at=timezone.now() - timedelta(days=3))
    queued = services.start_run(agent_name="support", message="hi", owner_id="alice", enqueue=False)

    assert reconcile.reconcile_stale_runs() == []

    for run, status in ((live, RunStatus.RUNNING), (settled, RunStatus.SUCCESS), (queued, RunStatus.QUEUED)):
        run.refresh_from_db()
        assert run.status == status
        assert run.error_code == ""


@committed
def test_tools_come_from_the_session_when_the_journal_is_empty(settings):
    settings.RUN_STALE_AFTER_SECONDS = 60
    done = run_now(params=script_params(LOOKUP, SEND_EMAIL, SAY_DONE))
    # The same run as if its worker had died before settling and its journal were empty.
    ToolCall.objects.filter(run=done).delete()
    AgentRun.objects.filter(pk=done.run_id).update(
        status=RunStatus.RUNNING, heartbeat_at=timezone.now() - timedelta(minutes=5), tools_executed=None
    )

    reconcile.reconcile_stale_runs()

    done.refresh_from_db()
    assert done.error_code == "reconciled"
    assert done.tools_executed == ["lookup_customer", "send_email"]


def test_tools_stay_unknown_when_neither_journal_nor_session_can_be_read(settings, monkeypatch):
    settings.RUN_STALE_AFTER_SECONDS = 60
    run = _running(heartbeat_age=timedelta(minutes=5))

    def unreadable(*args, **kwargs):
        raise DatabaseError("relation is unavailable")

    monkeypatch.setattr(journal, "journal_tools", unreadable)
    monkeypatch.setattr(journal, "session_tools", unreadable)
    reconcile.reconcile_stale_runs()

    run.refresh_from_db()
    assert run.error_code == "reconciled"
    assert run.tools_executed is None


@committed
def test_a_real_database_error_while_reading_tools_still_reconciles_with_tools_unknown(settings, monkeypatch):
    """On PostgreSQL a failed query aborts the locking transaction; the chunk is redone safely."""
    from django.db import connection

    settings.RUN_STALE_AFTER_SECONDS = 60
    broken = _running(heartbeat_age=timedelta(minutes=5))
    fine = _running(heartbeat_age=timedelta(minutes=5))
    _journal(fine, ("update_crm", ToolCallStatus.ANSWERED))
    real_journal_tools = journal.journal_tools

    def failing_for_one_run(run_id):
        if run_id == broken.run_id:
            with connection.cursor() as cursor:
                cursor.execute("SELECT * FROM no_such_table_anywhere")
        return real_journal_tools(run_id)

    def failing_session(run):
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM no_such_table_anywhere")

    monkeypatch.setattr(journal, "journal_tools", failing_for_one_run)
    monkeypatch.setattr(journal, "session_tools", failing_session)

    landed = reconcile.reconcile_stale_runs()

    assert {r.run_id for r in landed} == {broken.run_id, fine.run_id}
    broken.refresh_from_db()
    fine.refresh_from_db()
    assert (broken.error_code, broken.tools_executed) == ("reconciled", None)
    assert (fine.error_code, fine.tools_executed) == ("reconciled", ["update_crm"])


def test_a_run_with_no_calls_anywhere_is_reconciled_with_an_empty_list(settings):
    settings.RUN_STALE_AFTER_SECONDS = 60
    run = _running(heartbeat_age=timedelta(minutes=5))
    reconcile.reconcile_stale_runs()
    run.refresh_from_db()
    assert run.tools_executed == []


def test_a_heartbeat_that_arrives_first_wins(settings):
    settings.RUN_STALE_AFTER_SECONDS = 60
    run = _running(heartbeat_age=timedelta(minutes=5))
    ids = [run.run_id]
    assert lifecycle.beat(run_id=run.run_id)

    # The candidate was found stale, but the conditional write re-checks the rule.
    assert reconcile._reconcile_chunk(ids, reconcile.Cutoffs.at()) == []
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING


def test_reconciling_twice_lands_once(settings):
    settings.RUN_STALE_AFTER_SECONDS = 60
    run = _running(heartbeat_age=timedelta(minutes=5))
    assert len(reconcile.reconcile_stale_runs()) == 1
    first = AgentRun.objects.get(pk=run.run_id)
    assert reconcile.reconcile_stale_runs() == []
    assert AgentRun.objects.get(pk=run.run_id).error_message == first.error_message


def test_a_worker_that_finishes_after_reconciliation_keeps_both_facts(settings):
    settings.RUN_STALE_AFTER_SECONDS = 60
    run = _running(heartbeat_age=timedelta(minutes=5))
    _journal(run, ("send_email", ToolCallStatus.CALLED))
    reconcile.reconcile_stale_runs()

    # The worker was not dead after all: it answers and settles late.
    ToolCall.objects.filter(run=run).update(status=ToolCallStatus.ANSWERED)
    assert lifecycle.settle_run(run_id=run.run_id, status=RunStatus.SUCCESS, result="Emailed Jane.") is False

    run.refresh_from_db()
    assert (run.status, run.error_code) == (RunStatus.ERROR, "reconciled")
    assert run.tools_executed == ["send_email"]
    assert run.late_outcome["status"] == RunStatus.SUCCESS
    assert run.late_outcome["result"] == "Emailed Jane."
    assert run.late_outcome["tools_executed"] == ["send_email"]


# --- Reconcile on read ----------------------------------------------------------------------------


@committed
def test_reconcile_on_read_costs_no_query_for_a_live_run(settings, django_assert_num_queries):
    settings.RUN_STALE_AFTER_SECONDS = 60
    live = _running(heartbeat_age=timedelta(seconds=3))
    settled = run_now(params=script_params(SAY_DONE))
    with django_assert_num_queries(0):
        assert reconcile.reconcile_run_if_stale(live) is False
        assert reconcile.reconcile_run_if_stale(settled) is False


def test_reconcile_on_read_settles_a_stale_run_and_refreshes_it(settings):
    settings.RUN_STALE_AFTER_SECONDS = 60
    run = _running(heartbeat_age=timedelta(minutes=2))
    assert reconcile.reconcile_run_if_stale(run) is True
    assert run.status == RunStatus.ERROR
    assert run.error_code == "reconciled"
    assert run.tools_executed == []


def test_reconcile_on_read_leaves_a_run_whose_heartbeat_came_back(settings):
    settings.RUN_STALE_AFTER_SECONDS = 60
    run = _running(heartbeat_age=timedelta(minutes=2))
    lifecycle.beat(run_id=run.run_id)  # the instance in hand is older than the row
    assert reconcile.reconcile_run_if_stale(run) is False
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING


# --- Chat turns lost before they started ----------------------------------------------------------------


def test_a_chat_turn_lost_before_it_started_is_cancelled_not_handed_to_a_worker(settings):
    settings.RUN_STALE_AFTER_SECONDS = 300
    turn = services.start_run(agent_name="support", message="hi", owner_id="alice", trigger="chat", enqueue=False)
    AgentRun.objects.filter(pk=turn.run_id).update(created_at=timezone.now() - timedelta(minutes=6))

    report = reconcile.sweep()

    assert report.abandoned == 1
    turn.refresh_from_db()
    assert (turn.status, turn.error_code, turn.tools_executed) == ("cancelled", "abandoned", [])
    assert "nothing was executed" in turn.error_message


# --- Doors: the job, the command, the admin -------------------------------------------------------


def test_the_periodic_job_reconciles_and_reports(settings):
    settings.RUN_STALE_AFTER_SECONDS = 60
    run = _running(heartbeat_age=timedelta(minutes=2))
    # It wrote nothing (no event, no call): the system starts it again in a fresh session.
    assert reconcile_job() == (
        "1 stale run(s) reconciled, 0 abandoned chat turn(s) cancelled, "
        "1 run(s) continued by the system"
    )
    assert AgentRun.objects.get(pk=run.run_id).error_code == "reconciled"
    assert AgentRun.objects.filter(replay_of=run.run_id, resume_reason="recovered").count() == 1
    assert reconcile_job() == (
        "0 stale run(s) reconciled, 0 abandoned chat turn(s) cancelled, "
        "0 run(s) continued by the system"
    )


def test_reconcile_runs_command_prints_what_it_reconciled(settings):
    settings.RUN_STALE_AFTER_SECONDS = 60
    stale = _running(heartbeat_age=timedelta(minutes=2))
    _journal(stale, ("send_email", ToolCallStatus.CALLED))
    live = _running(heartbeat_age=timedelta(seconds=1))

    out = io.StringIO()
    call_command("reconcile_runs", stdout=out)
    text = out.getvalue()
    assert f"reconciled {stale.run_id} support owner=alice" in text
    assert "tools called: send_email" in text
    assert str(live.run_id) not in text
    assert "1 stale run(s) reconciled" in text

    out = io.StringIO()
    call_command("reconcile_runs", stdout=out)
    assert "0 stale run(s) reconciled" in out.getvalue()


def test_admin_page_of_a_stale_run_reconciles_it_and_shows_the_verdict(settings, support_agent, client):
    settings.RUN_STALE_AFTER_SECONDS = 60
    run = _running(heartbeat_age=timedelta(minutes=2))
    client.force_login(support_agent)

    page = client.get(reverse("admin:runs_agentrun_change", args=[run.run_id]))

    assert page.status_code == 200
    body = page.content.decode()
    assert "reconciled just now" in body
    assert "No completion was recorded" in body
    assert AgentRun.objects.get(pk=run.run_id).error_code == "reconciled"


def test_admin_filter_lists_only_stale_running_runs(settings, support_agent, client):
    settings.RUN_STALE_AFTER_SECONDS = 60
    stale = _running(heartbeat_age=timedelta(minutes=2))
    live = _running(heartbeat_age=timedelta(seconds=1))
    client.force_login(support_agent)

    page = client.get(reverse("admin:runs_agentrun_changelist"), {"stale": "yes"})

    assert page.status_code == 200
    body = page.content.decode()
    assert str(stale.run_id) in body
    assert str(live.run_id) not in body
    assert "stale running" in body


def test_admin_action_reconciles_the_stale_runs_and_reports_the_rest(settings, support_agent, client):
    settings.RUN_STALE_AFTER_SECONDS = 60
    stale = _running(heartbeat_age=timedelta(minutes=2))
    live = _running(heartbeat_age=timedelta(seconds=1))
    client.force_login(support_agent)
    url = reverse("admin:runs_agentrun_changelist")

    response = client.post(
        url,
        {"action": "reconcile_stale_runs_now", "_selected_action": [str(stale.run_id), str(live.run_id)]},
        follow=True,
    )

    assert response.status_code == 200
    shown = [str(m) for m in response.context["messages"]]
    assert any(m.startswith(f"Run {stale.run_id} reconciled.") for m in shown)
    assert any(m.startswith(f"Run {live.run_id} is still running") for m in shown)
    assert AgentRun.objects.get(pk=stale.run_id).error_code == "reconciled"
    assert AgentRun.objects.get(pk=live.run_id).status == RunStatus.RUNNING

    response = client.post(url, {"action": "reconcile_stale_runs_now", "_selected_action": [str(stale.run_id)]},
                           follow=True)
    assert "None of the selected runs is stale" in [str(m) for m in response.context["messages"]][-1]


def test_admin_action_is_offered_on_the_run_list(support_agent, client):
    client.force_login(support_agent)
    page = client.get(reverse("admin:runs_agentrun_changelist"))
    assert "Reconcile stale runs now" in page.content.decode()


def test_admin_page_shows_a_late_outcome_beside_the_reconciliation(settings, support_agent, client):
    settings.RUN_STALE_AFTER_SECONDS = 60
    run = _running(heartbeat_age=timedelta(minutes=2))
    _journal(run, ("send_email", ToolCallStatus.CALLED))
    reconcile.reconcile_stale_runs()
    lifecycle.settle_run(run_id=run.run_id, status=RunStatus.SUCCESS, result="Emailed Jane about her refund.")
    client.force_login(support_agent)

    body = client.get(reverse("admin:runs_agentrun_change", args=[run.run_id])).content.decode()

    assert "The worker finished after this run had already been settled as error (reconciled)" in body
    assert "It reported <strong>success</strong>" in body
    assert "Emailed Jane about her refund." in body
    assert "tools called: send_email" in body


# --- Real processes ---------------------------------------------------------------------------------



@pytest.mark.slow
@postgres_only
@committed
def test_a_worker_killed_mid_run_is_reconciled_within_the_stale_window(settings):
    settings.RUN_STALE_AFTER_SECONDS = 3
    child = run_manage(
        "run_agent", "support", "Email Jane about her refund", "--owner", "alice", "--inline",
        "--script", json.dumps([LOOKUP, dict(SEND_EMAIL, crash="after_effect"), UPDATE_CRM, SAY_DONE]),
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    run = AgentRun.objects.get(pk=child.stdout.splitlines()[0].strip())
    assert run.status == RunStatus.RUNNING

    # Inside the stale window the job leaves it alone: its last heartbeat is recent.
    if timezone.now() - run.heartbeat_at < timedelta(seconds=2):
        assert reconcile_job().startswith("0 stale run(s) reconciled")
        assert AgentRun.objects.get(pk=run.run_id).status == RunStatus.RUNNING

    # Once the window has passed, one run of the job settles it.
    wait = (run.heartbeat_at + timedelta(seconds=3.2) - timezone.now()).total_seconds()
    time.sleep(max(wait, 0))
    assert reconcile_job().startswith("1 stale run(s) reconciled")

    run.refresh_from_db()
    assert (run.status, run.error_code) == (RunStatus.ERROR, "reconciled")
    assert run.tools_executed == ["lookup_customer", "send_email"]  # the call in flight counts
    assert "actual outcome is unknown" in run.error_message

    # The replay rules: the email's call was never answered, so the run is refused with
    # `calls_in_doubt` until a person settles it (checked through the replay rules themselves
    # wherever they are part of the build; the read-only lookup never blocks).
    try:
        from runs.rules import replay
    except ImportError:
        replay = None
    if replay is not None:
        try:
            decision = replay.decide(run, force=False)
        except Exception as refusal:  # noqa: BLE001 - a refusal may be raised or returned
            decision = refusal
        assert getattr(decision, "code", None) == "calls_in_doubt"
        assert decision.refusal.context["tools"] == ["send_email"]


RECONCILER = """
import sys
import django; django.setup()
from runs.ledger import reconcile
print("ready", flush=True)
sys.stdin.readline()
for run in reconcile.reconcile_stale_runs():
    print(run.run_id, flush=True)
"""


@pytest.mark.slow
@postgres_only
@committed
def test_four_reconcilers_at_once_land_each_run_exactly_once(settings):
    long_ago = timezone.now() - timedelta(minutes=10)
    stale = AgentRun.objects.bulk_create(
        AgentRun(agent_name="support", owner_id=f"user-{i}", config={"message": "hi", "params": {}},
                 status=RunStatus.RUNNING, attempts=1, session_id=f"s-{i}", started_at=long_ago, heartbeat_at=long_ago)
        for i in range(3 * reconcile.CHUNK_SIZE + 17)
    )
    stale_ids = {run.run_id for run in stale}

    # Four reconcilers started and set up first, each waiting for a line on its stdin, so that the
    # race begins the moment both workers are inside their tools, however long Python takes to
    # start on a loaded machine.
    reconcilers = [
        subprocess.Popen(
            [sys.executable, "-c", RECONCILER],
            cwd=BASE_DIR, env=child_env(RUN_STALE_AFTER_SECONDS="2"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(4)
    ]
    try:
        for process in reconcilers:
            assert process.stdout.readline().strip() == "ready", process.stderr.read()[-2000:]
        _race(stale_ids, reconcilers)
    finally:
        for process in reconcilers:
            if process.poll() is None:
                process.kill()


def _race(stale_ids, reconcilers):

    # A live worker (heartbeat every 0.2 s) busy in a tool for the whole race, and a slow one that
    # beats so rarely it will look dead, then wakes up to a run that is no longer its own.
    script_live = json.dumps([dict(LOOKUP, hang=28), SAY_DONE])
    script_slow = json.dumps([dict(SEND_EMAIL, hang=22), SAY_DONE])
    live = subprocess.Popen(
        [sys.executable, "manage.py", "run_agent", "support", "live", "--owner", "live-worker", "--inline",
         "--script", script_live],
        cwd=BASE_DIR, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    slow = subprocess.Popen(
        [sys.executable, "manage.py", "run_agent", "support", "slow", "--owner", "slow-worker", "--inline",
         "--script", script_slow],
        cwd=BASE_DIR, env=child_env(RUN_HEARTBEAT_SECONDS="30", RUN_STALE_AFTER_SECONDS="61"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        running = lambda owner: AgentRun.objects.filter(owner_id=owner, status=RunStatus.RUNNING).first()  # noqa: E731
        live_run = wait_until(lambda: running("live-worker"), timeout=60)
        slow_run = wait_until(lambda: running("slow-worker"), timeout=60)
        # Both are journaled (their tools called) before they hang in them.
        wait_until(lambda: ToolCall.objects.filter(run=slow_run).exists(), timeout=30)
        wait_until(lambda: ToolCall.objects.filter(run=live_run).exists(), timeout=30)
        # The slow one's last beat must be older than the reconcilers' 2 s staleness.
        time.sleep(2.5)

        outputs = []
        for process in reconcilers:
            process.stdin.write("go\n")
            process.stdin.flush()
        for process in reconcilers:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, err[-2000:]
            outputs.append([line.strip() for line in out.splitlines() if line.strip()])

        landed = [run_id for output in outputs for run_id in output]
        # Every stale run (and the silent slow one) reconciled, none twice, the live one never.
        assert len(landed) == len(set(landed))
        assert set(landed) == {str(i) for i in stale_ids} | {str(slow_run.run_id)}
        assert str(live_run.run_id) not in landed
    finally:
        live_out = live.communicate(timeout=120)
        slow_out = slow.communicate(timeout=120)

    assert live.returncode == 0, live_out[1][-2000:]
    # The slow run's verdict is the reconciler's (an error): run_agent says it did not succeed.
    assert slow.returncode == 2, slow_out[1][-2000:]
    live_run.refresh_from_db()
    assert live_run.status == RunStatus.SUCCESS
    assert live_run.error_code == ""
    assert live_run.late_outcome is None

    # The slow worker's tool answered after the run was reconciled: that answer was refused (the
    # run's lease was gone), so the worker wrote nothing more and the verdict stands alone, the
    # email's call still in doubt.
    slow_run.refresh_from_db()
    assert (slow_run.status, slow_run.error_code) == (RunStatus.ERROR, "reconciled")
    assert slow_run.tools_executed == ["send_email"]
    assert slow_run.late_outcome is None
    assert list(ToolCall.objects.filter(run=slow_run).values_list("status", flat=True)) == [ToolCallStatus.CALLED]
    assert AgentRun.objects.filter(pk__in=stale_ids, error_code="reconciled").count() == len(stale_ids)
