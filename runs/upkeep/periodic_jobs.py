"""Every periodic job of Agent Ledger, and the one function that installs them.

`manage.py setup_schedules` (run after `migrate`) calls `setup_schedules()`: each job below is
created or brought up to date by name, so running it twice changes nothing. The jobs show in
the admin under "Background jobs › Scheduled tasks"; this list is the source of truth, so an
edit made there is undone by the next deploy.

To add a job, add a `Job` to `JOBS` (its task must be idempotent: django-q2 may deliver it twice).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction
from django_q.models import Schedule


@dataclass(frozen=True)
class Job:
    name: str
    func: str
    schedule_type: str
    minutes: int | None = None
    cron: str | None = None

    def fields(self) -> dict:
        return {
            "func": self.func,
            "schedule_type": self.schedule_type,
            "minutes": self.minutes,
            "cron": self.cron,
            "repeats": -1,
        }


JOBS: tuple[Job, ...] = (
    # docs/architecture.md, "Runs that die": stale running runs are reconciled and continued (a backstop of the workers' sweeps).
    Job(
        name="runs.reconcile",
        func="runs.tasks.reconcile_runs",
        schedule_type=Schedule.MINUTES,
        minutes=1,
    ),
    # Retention: ADK events older than EVENTS_RETENTION_DAYS, at night (03:30 in TIME_ZONE).
    Job(
        name="runs.purge_events",
        func="runs.tasks.purge_events",
        schedule_type=Schedule.CRON,
        cron="30 3 * * *",
    ),
    # Long-term memory retention: a no-op while MEMORY_RETENTION_DAYS is unset.
    Job(
        name="memory.prune",
        func="memory.tasks.prune_memories",
        schedule_type=Schedule.CRON,
        cron="45 3 * * *",
    ),
    # The webhook sweeper: wakes the workers when events are due (retries, expired leases, new ones).
    Job(
        name="runs.webhook_sweeper",
        func="runs.tasks.sweep_webhooks",
        schedule_type=Schedule.MINUTES,
        minutes=1,
    ),
    # Scheduled runs (RunSchedule): fires each due slot once; overlapping firings are skipped.
    Job(
        name="runs.fire_schedules",
        func="runs.tasks.fire_schedules",
        schedule_type=Schedule.MINUTES,
        minutes=1,
    ),
    # Retention of stored inputs: closed webhook events, their attachments, settled runs' input copies.
    Job(
        name="runs.purge_stored_inputs",
        func="runs.tasks.purge_stored_inputs",
        schedule_type=Schedule.CRON,
        cron="15 4 * * *",
    ),
    # Calls that waited past APPROVAL_TIMEOUT_SECONDS are rejected by the system; their runs go on.
    Job(
        name="runs.expire_approvals",
        func="runs.tasks.expire_approvals",
        schedule_type=Schedule.MINUTES,
        minutes=1,
    ),
    # More periodic jobs go here.
)


def setup_schedules(*, jobs: tuple[Job, ...] = JOBS) -> dict[str, str]:
    """Create or update every job by name; return {name: "created" | "updated" | "unchanged"}."""
    outcome: dict[str, str] = {}
    with transaction.atomic():
        for job in jobs:
            wanted = job.fields()
            schedule = Schedule.objects.select_for_update().filter(name=job.name).first()
            if schedule is None:
                # Schedule.save() computes the first run of a cron job; others start at once.
                Schedule(name=job.name, **wanted).save()
                outcome[job.name] = "created"
                continue
            changed = [key for key, value in wanted.items() if getattr(schedule, key) != value]
            if not changed:
                outcome[job.name] = "unchanged"
                continue
            for key in changed:
                setattr(schedule, key, wanted[key])
            update_fields = list(changed)
            if {"schedule_type", "cron", "minutes"} & set(changed):
                if schedule.schedule_type == Schedule.CRON:
                    schedule.next_run = schedule.calculate_next_run()
                    update_fields.append("next_run")
            schedule.save(update_fields=update_fields)
            outcome[job.name] = "updated"
    return outcome
