"""Recovery without a person (docs/architecture.md, "Recovery without a person").

A run that died (reconciled, or aborted by a drain) is continued by the system as a resume when
its resume decision needs nobody; otherwise it waits on the desk and says why. In-process runs
stopped at their second model call stand for a worker that died between two tool calls; the real
deaths (a SIGKILLed worker noticed by its cluster, a chaos burst) are on PostgreSQL below.
"""

from __future__ import annotations

import os
import random
import signal
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from agents.models import CrmNote, OutboxEmail
from runs.execution import executor
from runs.ledger import lifecycle, outcomes, reconcile
from runs.models.ledger import AgentRun, Recovery, RunStatus, ToolCallStatus
from runs.services import run as services
from runs.upkeep import recovery
from tests.factories import make_run, with_journal
from tests.helpers import (
    SEND_EMAIL,
    UPDATE_CRM,
    alive,
    chain_end,
    chain_ids,
    pid_of_worker,
    postgres_only,
    run_now,
    script_params,
    start_workers,
    stop_workers,
    wait_for_workers,
    worker_pids,
)
from tests.kit import api, login

# The continuation runs through ADK's engine, another connection: its commits must be seen.
db = pytest.mark.django_db(transaction=True)
SCRIPT = [SEND_EMAIL, UPDATE_CRM, {"say": "Emailed Jane and noted it."}]


def _died_between_two_tools(model_down_at_second_call, **fields) -> AgentRun:
    """A run that sent the email, then died before update_crm (reconciled, as after a SIGKILL)."""
    run = run_now(params=script_params(*SCRIPT))
    model_down_at_second_call()
    AgentRun.objects.filter(pk=run.pk).update(
        status=RunStatus.ERROR, error_code=fields.pop("error_code", reconcile.RECONCILED), **fields
    )
    run.refresh_from_db()
    return run


def _execute(run: AgentRun) -> AgentRun:
    executor.execute(run.run_id)
    run.refresh_from_db()
    return run


@db
@pytest.mark.parametrize("died_as", [reconcile.RECONCILED, outcomes.WORKER_SHUTDOWN, outcomes.DATABASE_LOST])
def test_a_run_that_died_between_two_tools_is_continued_by_the_system(died_as, model_down_at_second_call):
    original = _died_between_two_tools(model_down_at_second_call, error_code=died_as)
    resumed = recovery.recover(run_id=original.run_id)
    assert resumed is not None
    assert (resumed.resume_of_id, resumed.created_by, resumed.resume_reason) == (original.run_id, None, "recovered")
    assert resumed.trigger == original.trigger and resumed.session_id == original.session_id
    original.refresh_from_db()
    assert original.recovery == Recovery.RECOVERED
    assert str(resumed.run_id) in original.recovery_detail

    resumed = _execute(resumed)
    assert resumed.status == RunStatus.SUCCESS, resumed.error_message
    assert resumed.tools_executed == ["update_crm"]
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 1
    # Deciding again changes nothing: a run has one successor.
    assert recovery.recover(run_id=original.run_id) is None
    assert AgentRun.objects.filter(resume_of=original).count() == 1


def test_a_lost_database_connection_is_told_from_a_statement_that_failed():
    import psycopg
    from psycopg import errors

    def wrapped(error):
        try:
            try:
                raise error
            except Exception as cause:
                raise RuntimeError("Error in plugin 'agent_ledger_effects'") from cause
        except RuntimeError as outer:
            return outer

    closed = psycopg.OperationalError("server closed the connection unexpectedly")
    assert outcomes.database_lost_of(wrapped(closed)) is closed
    assert outcomes.database_lost_of(wrapped(errors.AdminShutdown("terminating connection"))) is not None
    assert outcomes.database_lost_of(wrapped(psycopg.InterfaceError("the connection is closed"))) is not None
    assert outcomes.database_lost_of(wrapped(errors.QueryCanceled("statement timeout"))) is None
    assert outcomes.database_lost_of(wrapped(ValueError("no"))) is None


@db
def test_a_run_that_died_before_it_wrote_anything_is_started_again_in_a_fresh_session():
    # Killed just after its claim: not even its input reached its session, so no tool ran.
    run = services.start_run(agent_name="support", message="Email Jane.", owner_id="jane",
                             params=script_params(*SCRIPT), enqueue=False)
    assert lifecycle.claim_run(run_id=run.run_id, worker="gone:1")
    [landed] = reconcile.reconcile_dead_worker(worker="gone:1")
    assert landed.tools_executed == []
    again = recovery.recover(run_id=run.run_id)
    assert again is not None
    assert (again.replay_of_id, again.resume_of_id, again.created_by, again.resume_reason) == (
        run.run_id, None, None, "recovered")
    assert again.session_id != run.session_id and again.trigger == run.trigger
    run.refresh_from_db()
    assert run.recovery == Recovery.RECOVERED and "before it wrote anything" in run.recovery_detail
    again = _execute(again)
    assert again.status == RunStatus.SUCCESS, again.error_message
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 1
    assert recovery.recover(run_id=run.run_id) is None


@db
def test_with_recovery_off_a_dead_run_waits_as_before(settings, model_down_at_second_call):
    settings.RUN_RECOVERY = "off"
    original = _died_between_two_tools(model_down_at_second_call)
    assert recovery.recover(run_id=original.run_id) is None
    assert recovery.recover_due() == []
    original.refresh_from_db()
    assert (original.recovery, original.recovery_detail) == ("", "")
    assert not AgentRun.objects.filter(resume_of=original).exists()


@db
def test_a_run_with_a_call_in_doubt_waits_for_a_person_and_says_why():
    # The email's call was stored, its tool never answered: it may have acted.
    original = make_run(tools=["send_email"], error_code=reconcile.RECONCILED, finished_at=timezone.now())
    from tests.factories import with_journal

    with_journal(original, [("send_email", "called", "idempotent")])
    assert recovery.recover(run_id=original.run_id) is None
    original.refresh_from_db()
    assert original.recovery == Recovery.NEEDS_PERSON
    assert "calls_in_doubt" in original.recovery_detail or "session_gone" in original.recovery_detail
    assert not AgentRun.objects.filter(resume_of=original).exists()


@db
def test_a_run_that_failed_for_its_own_reasons_is_not_continued(model_down_at_second_call):
    run = run_now(params=script_params(*SCRIPT))  # the provider is down: the run's own failure
    assert run.error_code == "model_error"
    assert recovery.recover(run_id=run.run_id) is None
    run.refresh_from_db()
    assert run.recovery == ""


@db
def test_recovery_is_bounded_per_chain_and_backs_off(settings, model_down_at_second_call):
    settings.RUN_RECOVERY_ATTEMPTS = 2
    settings.RUN_RECOVERY_BACKOFF_SECONDS = 30
    original = _died_between_two_tools(model_down_at_second_call, finished_at=timezone.now())
    first = recovery.recover(run_id=original.run_id)
    assert first is not None
    # The continuation died too, at once: the second attempt waits for its backoff.
    AgentRun.objects.filter(pk=first.pk).update(
        status=RunStatus.ERROR, error_code=reconcile.RECONCILED, finished_at=timezone.now()
    )
    assert recovery.recover(run_id=first.run_id) is None
    first.refresh_from_db()
    assert first.recovery == Recovery.PENDING and "30 s" in first.recovery_detail
    [second] = recovery.recover_due(now=timezone.now() + timedelta(seconds=31))
    assert second.resume_of_id == first.run_id and second.resume_reason == "recovered"
    AgentRun.objects.filter(pk=second.pk).update(
        status=RunStatus.ERROR, error_code=reconcile.RECONCILED, finished_at=timezone.now()
    )
    assert recovery.recover(run_id=second.run_id, now=timezone.now() + timedelta(hours=1)) is None
    second.refresh_from_db()
    assert second.recovery == Recovery.EXHAUSTED and "RUN_RECOVERY_ATTEMPTS=2" in second.recovery_detail


@db
def test_a_workflow_run_waits_for_a_person_with_the_reason(model_down_at_second_call):
    original = _died_between_two_tools(model_down_at_second_call)
    AgentRun.objects.filter(pk=original.pk).update(config={**original.config, "workflow": {"name": "wf"}})
    assert recovery.recover(run_id=original.run_id) is None
    original.refresh_from_db()
    assert original.recovery == Recovery.NEEDS_PERSON
    assert "workflow_not_resumable" in original.recovery_detail


@db
def test_the_api_tells_a_recovered_run_from_one_that_needs_a_person(admin_user, model_down_at_second_call):
    recovered = _died_between_two_tools(model_down_at_second_call)
    resumed = recovery.recover(run_id=recovered.run_id)
    waiting = make_run(tools=["send_email"], error_code=reconcile.RECONCILED, finished_at=timezone.now())
    recovery.recover(run_id=waiting.run_id)
    client = api(admin_user)
    body = client.get(f"/api/runs/{recovered.run_id}/").json()
    assert body["recovery"] == "recovered" and str(resumed.run_id) in body["recovery_detail"]
    assert client.get(f"/api/runs/{resumed.run_id}/").json()["resume_reason"] == "recovered"
    assert client.get(f"/api/runs/{waiting.run_id}/").json()["recovery"] == "needs_person"


@pytest.mark.django_db
def test_a_read_only_call_that_never_answered_is_not_in_doubt_on_any_door(admin_user):
    """Recovery continues a run that died inside a tool that only reads ("nothing it did was in
    doubt"); the API and the page must not then call that call in doubt."""
    run = with_journal(
        make_run(status=RunStatus.ERROR, error_code=reconcile.RECONCILED, finished_at=timezone.now()),
        [("send_email", "idempotent", ToolCallStatus.ANSWERED), ("lookup_customer", "read_only", ToolCallStatus.CALLED)],
    )
    client = api(admin_user)
    calls = {call["tool_name"]: call for call in client.get(f"/api/runs/{run.run_id}/").json()["tool_calls"]}
    assert (calls["lookup_customer"]["in_doubt"], calls["lookup_customer"]["state"]) == (False, "unanswered_read")
    assert "never answered; it only reads, so nothing is in doubt" in login(admin_user).get(
        f"/admin/runs/agentrun/{run.run_id}/change/").content.decode()
    # The rules read it the same way: a replay needs no force for it.
    assert client.get(f"/api/runs/{run.run_id}/").json()["replay_decision"]["code"] != "calls_in_doubt"


# --- Real deaths (PostgreSQL) -----------------------------------------------------------------------


def _wait_for(predicate, *, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


@postgres_only
@db
@pytest.mark.slow
def test_a_worker_sigkilled_between_two_tools_is_noticed_by_its_parent_and_finishes_by_itself(tmp_path):
    # The default stale window: only the parent's noticing (waitpid) can finish it this fast.
    cluster = start_workers(tmp_path / "workers.log", RUN_STALE_AFTER_SECONDS="60")
    try:
        script = [SEND_EMAIL, dict(UPDATE_CRM, latency=3), {"say": "Emailed Jane and noted it."}]
        run = services.start_run(agent_name="support", message="Email Jane.", owner_id="jane",
                                 params=script_params(*script))
        _wait_for(lambda: run.tool_calls.filter(tool_name="send_email", status="answered").exists(), seconds=90,
                  what="the email to be sent")
        pid = pid_of_worker(AgentRun.objects.get(pk=run.pk).worker)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        end = _wait_for(lambda: (e := chain_end(run)).status == RunStatus.SUCCESS and e, seconds=60,
                        what="the run to finish by itself")
        took = time.monotonic() - killed
        run.refresh_from_db()
        assert (run.status, run.error_code, run.recovery) == (RunStatus.ERROR, "reconciled", Recovery.RECOVERED)
        assert "died while it ran" in run.error_message
        assert end.resume_of_id == run.run_id and end.created_by is None
        assert OutboxEmail.objects.filter(run_id__in=chain_ids(run)).count() == 1 and CrmNote.objects.count() == 1
        assert took < 30, f"{took:.1f} s from the kill to success"
    finally:
        stop_workers(cluster)


@postgres_only
@db
@pytest.mark.slow
def test_chaos_random_kills_leave_every_run_finished_or_waiting_with_a_call_in_doubt(tmp_path):
    # Nobody sweeps for the workers: their parent notices deaths, and each worker sweeps by itself.
    rng = random.Random(24)
    log = tmp_path / "workers.log"
    cluster = start_workers(log, RUN_STALE_AFTER_SECONDS="4", RUN_RECOVERY_BACKOFF_SECONDS="1")
    runs = []
    try:
        wait_for_workers(log, cluster)
        script = [dict(UPDATE_CRM, latency=1), {"say": "Done.", "latency": 0.5}]
        runs = [
            services.start_run(agent_name="support", message=f"Email customer {i}.", owner_id=f"c{i}",
                               params=script_params(
                                   {"call": "send_email", "args": {"to": f"c{i}@example.com", "subject": "Hi",
                                                                   "body": "Hello."}},
                                   *script))
            for i in range(12)
        ]
        for _ in range(5):
            time.sleep(rng.uniform(1.0, 3.0))
            holding = AgentRun.objects.filter(status=RunStatus.RUNNING).exclude(worker="").values_list("worker", flat=True)
            victims = sorted({pid_of_worker(worker) for worker in holding})
            # Now and then an idle worker process instead of one holding runs.
            victims += [pid for pid in worker_pids(log) if alive(pid)] if rng.random() < 0.4 else []
            if victims:
                try:
                    os.kill(rng.choice(victims), signal.SIGKILL)
                except ProcessLookupError:
                    pass

        def settled() -> bool:
            ends = [chain_end(run) for run in runs]
            return all(
                end.status == RunStatus.SUCCESS
                or (end.status in (RunStatus.ERROR, RunStatus.CANCELLED)
                    and end.recovery in (Recovery.NEEDS_PERSON, Recovery.EXHAUSTED))
                for end in ends
            )

        _wait_for(settled, seconds=180, what="every run to finish or wait for a person")
    finally:
        stop_workers(cluster)
    for run in runs:
        end = chain_end(run)
        assert not AgentRun.objects.filter(pk__in=chain_ids(run), status=RunStatus.QUEUED).exists()
        if end.status != RunStatus.SUCCESS:
            # Waiting for a person, for a reason the desk shows: a call that may have acted, or a
            # chain killed more often than the system continues one.
            assert (end.recovery == Recovery.NEEDS_PERSON and "doubt" in end.recovery_detail) or (
                end.recovery == Recovery.EXHAUSTED and "RUN_RECOVERY_ATTEMPTS" in end.recovery_detail
            ), (end.error_code, end.recovery, end.recovery_detail)
        assert OutboxEmail.objects.filter(run_id__in=chain_ids(run)).count() <= 1
        assert CrmNote.objects.filter(run_id__in=chain_ids(run)).count() <= 1
