"""Retention of ADK events, and the periodic jobs that run it and the reconciliation."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.urls import reverse
from django.utils import timezone

from agents.models import AdkEvent, AdkSession
from runs.models.ledger import AgentRun, RunStatus, ToolCall
from runs.tasks import purge_events as purge_job
from runs.upkeep import retention
from tests.helpers import LOOKUP, SAY_DONE, SEND_EMAIL, read_settings, run_now, script_params

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed


@pytest.fixture(autouse=True)
def _empty_adk_tables():
    # ADK's tables are not Django's, so the flush between transactional tests leaves their
    # rows behind; a purge counts every event in the database, so start from none.
    AdkEvent.objects.all().delete()
    AdkSession.objects.all().delete()


def _age(run: AgentRun, days: int) -> int:
    """Move every event of the run's session `days` back in time; return how many there are."""
    events = AdkEvent.objects.filter(session_id=run.session_id)
    return events.update(timestamp=timezone.now() - timedelta(days=days))


@pytest.fixture
def history():
    """An old finished run, a recent one, and an old conversation whose run is still running."""
    old = run_now(params=script_params(LOOKUP, SEND_EMAIL, SAY_DONE), owner_id="old-customer")
    recent = run_now(params=script_params(SEND_EMAIL, SAY_DONE), owner_id="recent-customer")
    in_flight = run_now(params=script_params(SAY_DONE), owner_id="busy-customer")
    old_events = _age(old, 120)
    assert old_events == 6  # user message, 2 × (call, response), answer
    _age(in_flight, 120)
    AgentRun.objects.filter(pk=in_flight.run_id).update(status=RunStatus.RUNNING)
    return {"old": old, "recent": recent, "in_flight": in_flight, "old_events": old_events}


def _events(run: AgentRun) -> int:
    return AdkEvent.objects.filter(session_id=run.session_id).count()


@committed
def test_purge_deletes_only_old_events_in_batches_and_keeps_everything_else(history):
    old, recent, in_flight = history["old"], history["recent"], history["in_flight"]
    sessions_before = AdkSession.objects.count()
    runs_before = AgentRun.objects.count()
    journal_before = ToolCall.objects.count()
    recent_events, in_flight_events = _events(recent), _events(in_flight)
    batches: list[int] = []
    previous = 0

    def on_batch(report: retention.PurgeReport) -> None:
        nonlocal previous
        batches.append(report.deleted - previous)
        previous = report.deleted

    report = retention.purge_events(days=90, batch_size=4, on_batch=on_batch)

    assert report.deleted == history["old_events"] == 6
    assert batches == [4, 2]
    assert report.batches == 2
    assert _events(old) == 0
    assert _events(recent) == recent_events
    assert _events(in_flight) == in_flight_events  # still running: its session is left whole
    # Sessions keep their shell; runs and the journal are untouched.
    assert AdkSession.objects.count() == sessions_before
    assert AdkSession.objects.filter(id=old.session_id).exists()
    assert AgentRun.objects.count() == runs_before
    assert ToolCall.objects.count() == journal_before
    assert AgentRun.objects.get(pk=old.run_id).tools_executed == ["lookup_customer", "send_email"]


@committed
def test_a_queued_run_protects_its_conversation_too(history):
    conversation = history["in_flight"]
    AgentRun.objects.filter(pk=conversation.run_id).update(status=RunStatus.QUEUED)
    kept = _events(conversation)
    retention.purge_events(days=90, batch_size=100)
    assert _events(conversation) == kept
    # Once it has settled, the next purge takes its old events.
    AgentRun.objects.filter(pk=conversation.run_id).update(status=RunStatus.SUCCESS)
    assert retention.purge_events(days=90, batch_size=100).deleted == kept
    assert _events(conversation) == 0


@committed
def test_dry_run_deletes_nothing_and_reports_the_count(history):
    total = AdkEvent.objects.count()
    out = io.StringIO()
    call_command("purge_events", "--days", "90", "--dry-run", stdout=out)
    assert f"Dry run: {history['old_events']} event(s) older than" in out.getvalue()
    assert "nothing was deleted" in out.getvalue()
    assert AdkEvent.objects.count() == total


@committed
def test_the_command_prints_progress_and_a_summary(history):
    out = io.StringIO()
    call_command("purge_events", "--days", "90", "--batch-size", "5", stdout=out)
    text = out.getvalue()
    assert "batch 1: 5 event(s) deleted so far" in text
    assert "batch 2: 6 event(s) deleted so far" in text
    assert "Deleted 6 event(s) older than" in text
    assert "in 2 batch(es)" in text
    assert _events(history["old"]) == 0


@committed
def test_the_retention_period_decides_what_is_old(history):
    # 150 days: the 120-day-old events are within the period and stay.
    assert retention.purge_events(days=150).deleted == 0
    assert _events(history["old"]) == history["old_events"]


@committed
def test_the_daily_job_uses_the_settings(history, settings):
    settings.EVENTS_RETENTION_DAYS = 100
    settings.PURGE_BATCH_SIZE = 2
    summary = purge_job()
    assert summary.startswith("Deleted 6 event(s) older than")
    assert "in 3 batch(es)" in summary
    assert purge_job().startswith("Deleted 0 event(s)")


# --- Bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["--days", "0"], "--days must be at least 1 (got 0)"),
        (["--days", "-3"], "--days must be at least 1 (got -3)"),
        (["--days", "ninety"], "--days must be a whole number, got 'ninety'"),
        (["--days", "1.5"], "--days must be a whole number, got '1.5'"),
        (["--batch-size", "0"], "--batch-size must be between 1 and 100000 (got 0)"),
        (["--batch-size", "5000000"], "--batch-size must be between 1 and 100000 (got 5000000)"),
        (["--batch-size", "lots"], "--batch-size must be a whole number, got 'lots'"),
    ],
)
@committed
def test_bad_arguments_are_refused_and_nothing_is_deleted(history, args, words):
    total = AdkEvent.objects.count()
    with pytest.raises(CommandError) as caught:
        call_command("purge_events", *args, stdout=io.StringIO())
    assert words in str(caught.value)
    assert AdkEvent.objects.count() == total


@pytest.mark.parametrize(
    "name, value",
    [("EVENTS_RETENTION_DAYS", 0), ("EVENTS_RETENTION_DAYS", -1), ("PURGE_BATCH_SIZE", 0)],
)
@committed
def test_bad_settings_changed_at_run_time_are_refused_naming_them(history, settings, name, value):
    setattr(settings, name, value)
    total = AdkEvent.objects.count()
    with pytest.raises(retention.PurgeConfigError, match=f"{name} must be"):
        purge_job()
    with pytest.raises(CommandError, match=f"Nothing was deleted: {name} must be"):
        call_command("purge_events", stdout=io.StringIO())
    assert AdkEvent.objects.count() == total


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("EVENTS_RETENTION_DAYS", "0", "EVENTS_RETENTION_DAYS=0 is too small: it must be at least 1"),
        ("EVENTS_RETENTION_DAYS", "-7", "EVENTS_RETENTION_DAYS=-7 is too small"),
        ("EVENTS_RETENTION_DAYS", "ninety", "EVENTS_RETENTION_DAYS='ninety' is not a whole number"),
        ("PURGE_BATCH_SIZE", "0", "PURGE_BATCH_SIZE=0 is too small"),
        ("PURGE_BATCH_SIZE", "a few", "PURGE_BATCH_SIZE='a few' is not a whole number"),
        ("PURGE_BATCH_SIZE", "1000000", "PURGE_BATCH_SIZE=1000000 is too large"),
        ("STRIP_PAYLOAD_MIN_CHARS", "10", "STRIP_PAYLOAD_MIN_CHARS=10 is too small: it must be at least 256"),
        ("STRIP_PAYLOAD_MIN_CHARS", "big", "STRIP_PAYLOAD_MIN_CHARS='big' is not a whole number"),
        ("RUN_POLL_SECONDS", "0", "RUN_POLL_SECONDS=0.0 is too small"),
        ("RUN_WORKER_PROCESSES", "0", "RUN_WORKER_PROCESSES=0 is too small"),
        ("RUN_MAX_SILENCE_HOURS", "soon", "RUN_MAX_SILENCE_HOURS='soon' is not a whole number"),
    ],
)
def test_bad_settings_stop_start_up_naming_the_variable(name, value, words):
    with pytest.raises(ImproperlyConfigured) as refused:
        read_settings(**{name: value})
    assert words in str(refused.value)


# --- Schedules ------------------------------------------------------------------------------------


def _schedules() -> dict:
    from django_q.models import Schedule

    return {s.name: (s.func, s.schedule_type, s.minutes, s.cron, s.repeats, s.next_run) for s in Schedule.objects.all()}


def test_setup_schedules_creates_every_job_and_a_second_run_changes_nothing():
    from django_q.models import Schedule

    out = io.StringIO()
    call_command("setup_schedules", stdout=out)
    assert "runs.reconcile: created" in out.getvalue()
    assert "runs.purge_events: created" in out.getvalue()
    first = _schedules()
    assert first["runs.reconcile"][:5] == ("runs.tasks.reconcile_runs", Schedule.MINUTES, 1, None, -1)
    assert first["runs.purge_events"][:5] == ("runs.tasks.purge_events", Schedule.CRON, None, "30 3 * * *", -1)
    assert first["memory.prune"][:5] == ("memory.tasks.prune_memories", Schedule.CRON, None, "45 3 * * *", -1)
    assert first["runs.expire_approvals"][:5] == ("runs.tasks.expire_approvals", Schedule.MINUTES, 1, None, -1)
    # The nightly purge waits for its slot instead of running at deploy time.
    assert first["runs.purge_events"][5] > timezone.now()

    out = io.StringIO()
    call_command("setup_schedules", stdout=out)
    assert out.getvalue().split() == [
        "runs.reconcile:", "unchanged", "runs.purge_events:", "unchanged", "memory.prune:", "unchanged",
        "runs.webhook_sweeper:", "unchanged",
        "runs.fire_schedules:", "unchanged",
        "runs.purge_stored_inputs:", "unchanged",
        "runs.expire_approvals:", "unchanged",
    ]
    assert _schedules() == first


def test_setup_schedules_restores_a_job_edited_by_hand():
    from django_q.models import Schedule

    call_command("setup_schedules", stdout=io.StringIO())
    Schedule.objects.filter(name="runs.reconcile").update(minutes=30, repeats=0)
    out = io.StringIO()
    call_command("setup_schedules", stdout=out)
    assert "runs.reconcile: updated" in out.getvalue()
    reconcile_job = Schedule.objects.get(name="runs.reconcile")
    assert (reconcile_job.minutes, reconcile_job.repeats) == (1, -1)
    assert Schedule.objects.filter(name="runs.reconcile").count() == 1


@committed
def test_the_scheduler_enqueues_the_reconcile_job_and_it_runs():
    from django_q.models import OrmQ
    from django_q.scheduler import scheduler

    call_command("setup_schedules", stdout=io.StringIO())
    scheduler()
    queued = {task.task["func"]: task.task for task in OrmQ.objects.all()}
    # The every-minute jobs are due at once; the nightly ones wait for their slot.
    assert sorted(queued) == [
        "runs.tasks.expire_approvals", "runs.tasks.fire_schedules", "runs.tasks.reconcile_runs", "runs.tasks.sweep_webhooks",
    ]
    assert queued["runs.tasks.reconcile_runs"]["group"] == "runs.reconcile"
    assert queued["runs.tasks.sweep_webhooks"]["group"] == "runs.webhook_sweeper"


def test_the_jobs_show_in_the_admin(admin_client):
    call_command("setup_schedules", stdout=io.StringIO())
    page = admin_client.get(reverse("admin:django_q_schedule_changelist"))
    assert page.status_code == 200
    assert "runs.reconcile" in page.content.decode()
    assert "runs.purge_events" in page.content.decode()
