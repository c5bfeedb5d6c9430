"""Many runs in flight per worker process: the pool, its heartbeat, backpressure and drain.

The pool's own rules run in this process on both databases (the pool and the process's agent
loop are the real ones). What needs several processes — a worker SIGKILLed with 50 runs in
flight, SIGTERM with runs in flight, two workers sharing a backlog — runs real
`manage.py runworker` processes on PostgreSQL.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from agents.models import CrmNote, OutboxEmail
from runs.execution.executor import execute as execute_run
from runs.ledger import lifecycle, reconcile
from runs.ledger.outcomes import WORKER_SHUTDOWN
from runs.models.ledger import AgentRun, RunStatus, ToolCallStatus
from runs.services import run as services
from runs.worker import processes as worker
from tests.helpers import (
    BASE_DIR,
    LOOKUP,
    SAY_DONE,
    SEND_EMAIL,
    UPDATE_CRM,
    child_env,
    postgres_only,
    script_params,
    stop_cluster,
    wait_until,
)

# Worker processes and threads read what the test committed, and the test reads theirs.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HANGING = script_params(LOOKUP, SEND_EMAIL, dict(UPDATE_CRM, hang=120), SAY_DONE)
ALL_THREE = ["lookup_customer", "send_email", "update_crm"]


def _start(count: int, params: dict, *, enqueue: bool = False) -> list[AgentRun]:
    return [
        services.start_run(agent_name="support", message=f"run {i}", owner_id="alice", params=params, enqueue=enqueue)
        for i in range(count)
    ]



def _in_hanging_tool(runs: list[AgentRun]) -> int:
    return (
        AgentRun.objects.filter(pk__in=[r.pk for r in runs], tool_calls__tool_name="update_crm").distinct().count()
    )


def _statuses(runs: list[AgentRun]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status in AgentRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True):
        counts[status] = counts.get(status, 0) + 1
    return counts


# --- The pool in this process (both databases) ---------------------------------------------------


def test_a_pool_keeps_many_runs_in_flight_at_once_and_settles_each_once():
    pool = worker.RunPool(capacity=10)
    # Each model call takes 0.5 s of "provider time": one at a time this would take 10 × 1.5 s.
    slow = script_params(dict(LOOKUP, latency=0.5), dict(SEND_EMAIL, latency=0.5), {"say": "Done.", "latency": 0.5})
    runs = _start(10, slow)
    started = time.monotonic()
    assert pool.claim(worker="w1") == 10
    wait_until(lambda: pool.in_flight == 0, timeout=60, what="the runs to settle")
    took = time.monotonic() - started

    assert _statuses(runs) == {RunStatus.SUCCESS: 10}
    assert took < 10, f"10 runs of 1.5 s took {took:.1f} s: they did not run side by side"
    for run in AgentRun.objects.filter(pk__in=[r.pk for r in runs]):
        assert run.attempts == 1
        assert run.tools_executed == ["lookup_customer", "send_email"]
        assert OutboxEmail.objects.filter(run_id=run.run_id).count() == 1
    # Nothing is left to claim, in the pool or outside it.
    assert pool.claim(worker="w1") == 0
    assert execute_run(str(runs[0].run_id)) == "not claimed"
    assert OutboxEmail.objects.count() == 10


def test_a_full_pool_claims_only_as_many_runs_as_it_has_free_slots(admin_user):
    pool = worker.RunPool(capacity=2)
    busy = _start(2, HANGING)
    [waiting] = _start(1, HANGING)
    assert pool.claim(worker="w1") == 2
    assert pool.claim(worker="w1") == 0
    waiting.refresh_from_db()
    assert (waiting.status, waiting.attempts, waiting.worker) == (RunStatus.QUEUED, 0, "")
    assert {r.status for r in AgentRun.objects.filter(pk__in=[r.pk for r in busy])} == {RunStatus.RUNNING}

    # A slot that frees is taken by the next claim.
    services.cancel_run(busy[0].run_id, actor=admin_user)
    wait_until(lambda: pool.in_flight == 1, timeout=30, what="the cancelled run to leave the pool")
    assert pool.claim(worker="w1") == 1
    wait_until(lambda: _in_hanging_tool([waiting]) == 1, timeout=30, what="the third run to start")
    assert pool.drain(seconds=0)
    assert _statuses(busy + [waiting]) == {RunStatus.CANCELLED: 1, RunStatus.ERROR: 2}


def test_claims_split_a_backlog_oldest_first_and_never_take_a_run_twice():
    runs = _start(5, script_params(SAY_DONE))
    first = lifecycle.claim_queued_runs(worker="w1", limit=3)
    second = lifecycle.claim_queued_runs(worker="w2", limit=3)
    assert [r.run_id for r in first] == [r.run_id for r in runs[:3]]
    assert [r.run_id for r in second] == [r.run_id for r in runs[3:]]
    assert lifecycle.claim_queued_runs(worker="w3", limit=3) == []
    claimed = {r.run_id: r for r in first + second}
    # Each claim is a new lease, and the row as claimed comes back with it.
    assert len({r.lease for r in claimed.values()}) == 5 and None not in {r.lease for r in claimed.values()}
    for row in AgentRun.objects.filter(pk__in=claimed):
        assert (row.status, row.attempts, row.lease) == (RunStatus.RUNNING, 1, claimed[row.pk].lease)
        assert row.worker == ("w1" if row.pk in {r.run_id for r in first} else "w2")


def test_a_chat_turn_is_left_to_its_server_until_it_waited():
    turn = services.start_run(agent_name="support", message="hi", owner_id="alice", trigger="chat", enqueue=False)
    assert lifecycle.claim_queued_runs(worker="w1", limit=10) == []
    # Queued again after a decision (runs.ledger.approvals), it is a worker's like any run.
    AgentRun.objects.filter(pk=turn.pk).update(attempts=1)
    assert [r.run_id for r in lifecycle.claim_queued_runs(worker="w1", limit=10)] == [turn.run_id]


def test_run_queued_claims_and_runs_what_is_queued_here():
    runs = _start(3, script_params(SEND_EMAIL, SAY_DONE))
    assert worker.run_queued() == [RunStatus.SUCCESS] * 3
    assert worker.run_queued() == []
    assert sorted(OutboxEmail.objects.values_list("run_id", flat=True)) == sorted(r.run_id for r in runs)


def test_cancelling_one_run_among_many_leaves_the_others_running(admin_user):
    pool = worker.RunPool(capacity=20)
    runs = _start(8, HANGING)
    assert pool.claim(worker="w1") == 8
    wait_until(lambda: _in_hanging_tool(runs) == 8, timeout=60, what="every run to reach its hanging tool")

    asked = time.monotonic()
    services.cancel_run(runs[3].run_id, actor=admin_user)
    wait_until(
        lambda: AgentRun.objects.get(pk=runs[3].pk).status == RunStatus.CANCELLED, timeout=30, what="the cancel"
    )
    took = time.monotonic() - asked
    assert took < settings.RUN_HEARTBEAT_SECONDS * 25, f"cancellation took {took:.1f} s"
    cancelled = AgentRun.objects.get(pk=runs[3].pk)
    assert cancelled.tools_executed == ALL_THREE
    assert _statuses(runs) == {RunStatus.CANCELLED: 1, RunStatus.RUNNING: 7}
    # The pool lets go of the run once its task has ended, a moment after the cancel is written.
    wait_until(lambda: pool.in_flight == 7, timeout=30, what="the pool to let go of the cancelled run")
    # The others are alive: their heartbeat keeps moving.
    before = {r.pk: r.heartbeat_at for r in AgentRun.objects.filter(status=RunStatus.RUNNING)}
    time.sleep(settings.RUN_HEARTBEAT_SECONDS * 3)
    after = {r.pk: r.heartbeat_at for r in AgentRun.objects.filter(status=RunStatus.RUNNING)}
    assert all(after[pk] > before[pk] for pk in before)
    pool.drain(seconds=0)


def test_a_drain_lets_finishing_runs_finish_and_aborts_the_rest_with_their_tools_listed(settings):
    settings.RUN_DRAIN_SECONDS = 2
    pool = worker.RunPool(capacity=10)
    finishing = _start(3, script_params(dict(LOOKUP, latency=0.5), {"say": "Done.", "latency": 0.5}))
    stuck = _start(3, HANGING)
    assert pool.claim(worker="w1") == 6
    wait_until(lambda: _in_hanging_tool(stuck) == 3, timeout=60, what="the stuck runs to reach their tool")

    asked = time.monotonic()
    aborted = pool.drain(seconds=settings.RUN_DRAIN_SECONDS)
    took = time.monotonic() - asked

    assert sorted(aborted) == sorted(r.run_id for r in stuck)
    assert settings.RUN_DRAIN_SECONDS <= took < settings.RUN_DRAIN_SECONDS + 20
    assert _statuses(finishing) == {RunStatus.SUCCESS: 3}
    for run in AgentRun.objects.filter(pk__in=[r.pk for r in stuck]):
        assert (run.status, run.error_code) == (RunStatus.ERROR, WORKER_SHUTDOWN)
        assert "RUN_DRAIN_SECONDS=2 s" in run.error_message
        assert run.tools_executed == ALL_THREE
        assert run.tool_calls.get(tool_name="update_crm").status == ToolCallStatus.FAILED
    assert CrmNote.objects.count() == 0  # stopped before the hanging tool's effect
    # A draining pool claims nothing more; the run stays queued for another worker.
    [late] = _start(1, HANGING)
    assert pool.claim(worker="w1") == 0
    assert AgentRun.objects.get(pk=late.pk).status == RunStatus.QUEUED


def test_one_heartbeat_refreshes_every_run_of_the_process_and_reads_their_cancels(admin_user):
    runs = _start(5, HANGING)
    for run in runs:
        assert lifecycle.claim_run(run_id=run.run_id, worker="w1")
    services.cancel_run(runs[1].run_id, actor=admin_user)
    lifecycle.settle_run(run_id=runs[4].run_id, status=RunStatus.SUCCESS)
    past = timezone.now() - timedelta(seconds=5)
    AgentRun.objects.update(heartbeat_at=past)

    held = dict(AgentRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("pk", "lease"))
    beat = lifecycle.beat_many(held=held)

    assert beat.cancel_requested == {runs[1].run_id}
    assert beat.lost == {runs[4].run_id}  # settled: this process no longer holds it
    beats = dict(AgentRun.objects.values_list("pk", "heartbeat_at"))
    assert all(beats[r.pk] > past for r in runs[:4])
    assert beats[runs[4].pk] == past  # settled: no longer beaten


def test_latency_is_validated_like_any_step():
    from agents.scripted import ScriptError, validate_script

    assert validate_script([{"say": "hi", "latency": 1.5}])
    for bad in (-1, True, "1", 601):
        with pytest.raises(ScriptError, match="latency"):
            validate_script([{"say": "hi", "latency": bad}])


# --- Real worker processes (PostgreSQL) -------------------------------------------------------------


def _start_cluster(**env: str) -> subprocess.Popen:
    """`runworker` with one worker process."""
    environment = child_env(RUN_POLL_SECONDS="0.5", **env)
    return subprocess.Popen(
        [sys.executable, "manage.py", "runworker", "--processes", "1"],
        cwd=BASE_DIR,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _other_transactions() -> int:
    # Other connections of this process (ADK's pool) stay open but idle: only an open
    # transaction can hold a run's row.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND xact_start IS NOT NULL"
        )
        return cursor.fetchone()[0]


@pytest.fixture
def clusters():
    started: list[subprocess.Popen] = []

    def start(**env: str) -> subprocess.Popen:
        cluster = _start_cluster(**env)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        stop_cluster(cluster)
    connection.close()


@postgres_only
def test_a_worker_killed_with_50_runs_in_flight_settles_every_run_once_in_one_sweep(clusters):
    cluster = clusters()
    runs = _start(50, HANGING, enqueue=True)
    wait_until(lambda: _in_hanging_tool(runs) == 50, timeout=120, what="50 runs in flight in one worker")
    assert len(set(AgentRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("worker", flat=True))) == 1

    stop_cluster(cluster)
    assert _statuses(runs) == {RunStatus.RUNNING: 50}
    # A killed client's server backend lives on until it reads the closed socket, holding the row
    # it was heartbeating; a sweep that met it would rightly skip that row until the next sweep.
    wait_until(lambda: _other_transactions() == 0, timeout=60, what="the killed worker's transactions to end")

    # Their one heartbeat stopped for all of them at once: one sweep, past the stale window.
    report = reconcile.sweep(now=timezone.now() + timedelta(seconds=settings.RUN_STALE_AFTER_SECONDS + 1))
    assert sorted(r.run_id for r in report.reconciled) == sorted(r.run_id for r in runs)

    for run in AgentRun.objects.filter(pk__in=[r.pk for r in runs]):
        assert (run.status, run.error_code, run.attempts) == (RunStatus.ERROR, "reconciled", 1)
        assert run.tools_executed == ALL_THREE
        assert OutboxEmail.objects.filter(run_id=run.run_id).count() == 1
        # Nothing is left to claim.
        assert execute_run(str(run.run_id)) == "not claimed"
    assert OutboxEmail.objects.count() == 50
    assert CrmNote.objects.count() == 0


@postgres_only
def test_sigterm_drains_the_worker_then_aborts_what_is_left(clusters):
    cluster = clusters(RUN_DRAIN_SECONDS="5")
    stuck = _start(5, HANGING, enqueue=True)
    wait_until(lambda: _in_hanging_tool(stuck) == 5, timeout=60, what="the stuck runs to reach their tool")
    finishing = _start(5, script_params(dict(LOOKUP, latency=1), {"say": "Done.", "latency": 0.5}), enqueue=True)
    wait_until(
        lambda: _statuses(finishing).get(RunStatus.RUNNING) == 5, timeout=30, what="the finishing runs to start"
    )

    asked = time.monotonic()
    cluster.send_signal(signal.SIGTERM)  # the parent only, as `serve` and a process manager do
    cluster.wait(timeout=90)
    took = time.monotonic() - asked

    assert took >= 5, "the worker did not wait for its runs"
    outcomes = list(AgentRun.objects.filter(pk__in=[r.pk for r in finishing]).values_list("status", "error_message"))
    assert _statuses(finishing) == {RunStatus.SUCCESS: 5}, outcomes
    for run in AgentRun.objects.filter(pk__in=[r.pk for r in stuck]):
        assert (run.status, run.error_code) == (RunStatus.ERROR, WORKER_SHUTDOWN), run.error_message
        assert run.tools_executed == ALL_THREE
    # Nothing was left for reconciliation.
    assert not reconcile.sweep(now=timezone.now() + timedelta(hours=1)).reconciled


@postgres_only
def test_a_full_worker_leaves_the_backlog_to_another_worker(clusters):
    full = {"RUN_CONCURRENCY": "2"}
    clusters(**full)
    first = _start(2, HANGING, enqueue=True)
    wait_until(lambda: _in_hanging_tool(first) == 2, timeout=60, what="the first worker to fill")
    [first_worker] = set(AgentRun.objects.filter(pk__in=[r.pk for r in first]).values_list("worker", flat=True))

    more = _start(2, HANGING, enqueue=True)
    time.sleep(3)
    assert _statuses(more) == {RunStatus.QUEUED: 2}, "a full worker took more runs"
    clusters(**full)
    wait_until(lambda: _in_hanging_tool(more) == 2, timeout=60, what="the second worker to take the backlog")
    workers = set(AgentRun.objects.filter(pk__in=[r.pk for r in more]).values_list("worker", flat=True))
    assert len(workers) == 1 and first_worker not in workers
    assert AgentRun.objects.filter(attempts__gt=1).count() == 0
