"""Scheduled runs: staff schedule an agent or a workflow; each slot fires once, never stacked."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest
from django.utils import timezone
from django_q.models import OrmQ

from agents.services import save_workflow
from runs.execution import executor
from runs.ledger import lifecycle
from runs.management.commands.seed_demo import DEMO_WORKFLOW
from runs.models.ledger import AgentRun, RunStatus, StepStatus, Trigger
from runs.models.schedules import FiringOutcome, RunSchedule, ScheduleFiring
from runs.schedules import services as scheduling
from runs.tasks import fire_schedules
from tests.helpers import BASE_DIR, SAY_DONE, child_env, postgres_only

# Scheduled runs execute on the agent loop; two schedulers race in separate processes.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed


def make_schedule(**fields) -> RunSchedule:
    values = {
        "name": "morning check",
        "agent_name": "support",
        "message": "Check on Jane's refund.",
        "owner_id": "jane",
        "params": {"script": [SAY_DONE]},
        "kind": "interval",
        "interval_minutes": 60,
    }
    values.update(fields)
    schedule = RunSchedule(**values)
    schedule.full_clean()
    schedule.save()
    return schedule


def make_due(schedule: RunSchedule, *, ago: timedelta = timedelta(seconds=5)) -> None:
    RunSchedule.objects.filter(pk=schedule.pk).update(next_fire_at=timezone.now() - ago)


@committed
def test_a_due_schedule_fires_a_run_with_trigger_schedule_written_before_it_starts():
    schedule = make_schedule()
    assert timezone.now() + timedelta(minutes=59) < schedule.next_fire_at <= timezone.now() + timedelta(minutes=60)
    assert fire_schedules() == "started 0, skipped 0, failed 0"

    make_due(schedule)
    assert fire_schedules() == "started 1, skipped 0, failed 0"

    run = AgentRun.objects.get()
    assert run.trigger == Trigger.SCHEDULE
    assert run.created_by is None
    assert (run.agent_name, run.owner_id, run.message) == ("support", "jane", "Check on Jane's refund.")
    assert run.status == RunStatus.QUEUED
    # Claimable by a worker; nothing passes through the periodic jobs' broker.
    assert list(lifecycle.claimable_runs()) == [run]
    assert not OrmQ.objects.exists()
    schedule.refresh_from_db()
    assert schedule.last_run == run
    assert schedule.next_fire_at > timezone.now()
    firing = ScheduleFiring.objects.get()
    assert (firing.outcome, firing.run) == (FiringOutcome.STARTED, run)

    # The job comes again (at-least-once delivery): the slot was taken, nothing more starts.
    assert fire_schedules() == "started 0, skipped 0, failed 0"
    assert scheduling.fire_schedule(schedule.pk, slot=firing.slot) is None
    assert AgentRun.objects.count() == 1

    executor.execute(run.run_id)
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCESS
    assert run.result == "Done."


@committed
def test_an_overlapping_firing_is_skipped_and_recorded_not_stacked():
    schedule = make_schedule()
    make_due(schedule)
    fire_schedules()
    first = AgentRun.objects.get()

    make_due(schedule)
    assert fire_schedules() == "started 0, skipped 1, failed 0"
    assert AgentRun.objects.count() == 1
    skipped = ScheduleFiring.objects.get(outcome=FiringOutcome.SKIPPED)
    assert skipped.blocking_run == first
    assert skipped.run is None
    assert f"The previous run {first.run_id} of this schedule was still queued" in skipped.detail
    schedule.refresh_from_db()
    assert schedule.last_skipped_at is not None
    assert schedule.last_skip_reason == skipped.detail
    assert schedule.last_run == first
    assert schedule.next_fire_at > timezone.now()

    # Once the previous run has finished, the schedule fires again.
    executor.execute(first.run_id)
    make_due(schedule)
    assert fire_schedules() == "started 1, skipped 0, failed 0"
    assert AgentRun.objects.filter(trigger=Trigger.SCHEDULE).count() == 2


@committed
def test_a_scheduled_workflow_runs_with_its_steps():
    save_workflow(**DEMO_WORKFLOW)
    schedule = make_schedule(agent_name="refund_review", params={})
    make_due(schedule)
    fire_schedules()
    run = AgentRun.objects.get()
    assert run.trigger == Trigger.SCHEDULE
    assert run.workflow["name"] == "refund_review"
    executor.execute(run.run_id)
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCESS, run.error_message
    assert run.steps.count() == 5
    assert set(run.steps.values_list("status", flat=True)) == {StepStatus.SUCCESS}


def test_a_firing_that_cannot_start_its_run_is_recorded_and_the_schedule_moves_on():
    workflow = save_workflow(**DEMO_WORKFLOW)
    schedule = make_schedule(agent_name="refund_review", params={})
    workflow.delete()
    make_due(schedule)
    assert fire_schedules() == "started 0, skipped 0, failed 1"
    firing = ScheduleFiring.objects.get()
    assert firing.outcome == FiringOutcome.FAILED
    assert "There is no agent named 'refund_review'" in firing.detail
    assert not AgentRun.objects.exists()
    schedule.refresh_from_db()
    assert schedule.next_fire_at > timezone.now()


def test_missed_slots_are_not_caught_up_and_interval_schedules_keep_their_grid():
    schedule = make_schedule(interval_minutes=10)
    slot = schedule.next_fire_at
    # The scheduler was down for 35 minutes: one firing, then the next slot on the same grid.
    now = slot + timedelta(minutes=35)
    assert scheduling.fire_schedule(schedule.pk, slot=slot, now=now).outcome == FiringOutcome.STARTED
    schedule.refresh_from_db()
    assert schedule.next_fire_at == slot + timedelta(minutes=40)


def test_cron_schedules_fire_on_their_cron(settings):
    settings.TIME_ZONE = "UTC"
    schedule = make_schedule(kind="cron", interval_minutes=None, cron="30 7 * * *")
    after = timezone.now()
    expected = after.replace(hour=7, minute=30, second=0, microsecond=0)
    if expected <= after:
        expected += timedelta(days=1)
    assert schedule.next_fire_at == expected


def test_disabling_a_schedule_stops_it():
    schedule = make_schedule()
    schedule.enabled = False
    schedule.save()
    assert schedule.next_fire_at is None
    assert fire_schedules() == "started 0, skipped 0, failed 0"


# --- The admin --------------------------------------------------------------------------------------


def _form(**fields) -> dict:
    data = {
        "name": "nightly", "enabled": "on", "agent_name": "support", "message": "Check the queue.",
        "owner_id": "ops", "params": json.dumps({"script": [SAY_DONE]}), "kind": "interval",
        "interval_minutes": "15", "cron": "",
        "firings-TOTAL_FORMS": "0", "firings-INITIAL_FORMS": "0", "firings-MIN_NUM_FORMS": "0",
        "firings-MAX_NUM_FORMS": "0",
    }
    data.update(fields)
    return data


def test_staff_schedule_an_agent_in_the_admin(admin_client, admin_user):
    response = admin_client.post("/admin/runs/runschedule/add/", _form())
    assert response.status_code == 302, response.content.decode()[:4000]
    schedule = RunSchedule.objects.get()
    assert schedule.created_by == admin_user
    assert timezone.now() + timedelta(minutes=14) < schedule.next_fire_at <= timezone.now() + timedelta(minutes=15)

    make_due(schedule)
    fire_schedules()
    page = admin_client.get(f"/admin/runs/runschedule/{schedule.pk}/change/").content.decode()
    assert "started a run" in page
    assert str(AgentRun.objects.get().run_id)[:8] in page


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"agent_name": "ghost"}, "There is no agent named &#x27;ghost&#x27;"),
        ({"kind": "cron", "interval_minutes": "", "cron": "every monday"}, "is not a five-field cron expression"),
        ({"kind": "cron", "interval_minutes": "", "cron": "61 * * * *"}, "is not a valid cron expression"),
        ({"interval_minutes": ""}, "An interval schedule needs interval_minutes"),
        ({"message": "   "}, "The message is empty"),
        ({"params": json.dumps({"script": [{"call": "teleport"}]})}, "the agent has no tool named &#x27;teleport&#x27;"),
    ],
)
def test_the_admin_refuses_a_bad_schedule_with_the_reason(admin_client, fields, message):
    response = admin_client.post("/admin/runs/runschedule/add/", _form(**fields))
    assert response.status_code == 200
    page = response.content.decode()
    assert message in page
    assert not RunSchedule.objects.exists()


# --- Concurrent schedulers (real processes on PostgreSQL) -------------------------------------------


@pytest.mark.slow
@postgres_only
@committed
def test_two_schedulers_at_once_fire_each_slot_once():
    schedules = [make_schedule(name=f"s{i}") for i in range(5)]
    for schedule in schedules:
        make_due(schedule)
    code = "import django; django.setup()\nfrom runs.tasks import fire_schedules\nprint(fire_schedules())"
    processes = [
        subprocess.Popen([sys.executable, "-c", code], cwd=BASE_DIR, env=child_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    assert AgentRun.objects.count() == 5
    assert ScheduleFiring.objects.filter(outcome=FiringOutcome.STARTED).count() == 5
    started = sum(int(out.split()[1].rstrip(",")) for out, _err in outputs)
    assert started == 5


def test_a_schedule_without_params_is_saved_with_empty_params(admin_client):
    response = admin_client.post("/admin/runs/runschedule/add/", _form(params=""))
    assert response.status_code == 302, response.content.decode()[:3000]
    assert RunSchedule.objects.get().params == {}


def test_a_schedule_made_outside_the_admin_gets_its_first_slot_and_a_new_one_when_retimed():
    # The first slot is the model's rule, so the shell, a fixture or an API set it like the admin.
    before = timezone.now()
    schedule = RunSchedule.objects.create(
        name="from-the-shell", agent_name="support", message="Daily digest.", owner_id="jane",
        params={"script": [SAY_DONE]}, kind="interval", interval_minutes=30,
    )
    assert schedule.next_fire_at is not None
    assert before + timedelta(minutes=30) <= schedule.next_fire_at <= timezone.now() + timedelta(minutes=30)

    first = schedule.next_fire_at
    reloaded = RunSchedule.objects.get(pk=schedule.pk)
    reloaded.message = "Another digest."  # not timing: the slot stays
    reloaded.save()
    assert reloaded.next_fire_at == first

    reloaded.interval_minutes = 5  # timing: the next slot follows the new interval
    reloaded.save()
    assert reloaded.next_fire_at <= timezone.now() + timedelta(minutes=5)
    assert RunSchedule.objects.get(pk=schedule.pk).next_fire_at == reloaded.next_fire_at
