"""Scheduled runs: an agent or a workflow started with a fixed input, every N minutes or on a cron.

One periodic django-q2 job (`runs.fire_schedules`, every minute; see runs/upkeep/periodic_jobs.py) fires the
schedules that are due. `RunSchedule` is the only record of what is scheduled, so there is
nothing to keep in sync with django-q2's own Schedule rows, and the rules live here:

- a firing claims its slot with `UPDATE … SET next_fire_at = <next slot> WHERE next_fire_at =
  <this slot>` and checks the row count, so concurrent schedulers and a redelivered job fire each
  slot once; the run (or the skip) is written in the same transaction, and the firing row is
  unique per (schedule, slot) as well;
- a firing while the schedule's previous run is still queued or running is skipped and
  recorded (`ScheduleFiring` with the blocking run, and `last_skipped_at`/`last_skip_reason`),
  never stacked;
- each firing starts its run through `runs.services.run.start_run` with trigger `schedule` and no
  `created_by`, so it is written down before it starts and obeys the replay rules;
- slots missed while nothing was running are not caught up: the next slot is the first one
  after now.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from runs.inputs.schedules import next_slot
from runs.ledger import reconcile
from runs.models.ledger import UNSETTLED, AgentRun, Trigger
from runs.models.schedules import FiringOutcome, RunSchedule, ScheduleFiring
from runs.services import run as services

logger = logging.getLogger(__name__)

MAX_DUE_PER_TICK = 500


# --- Firing ------------------------------------------------------------------------------------------


@dataclass
class FiringReport:
    started: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"started {len(self.started)}, skipped {len(self.skipped)}, failed {len(self.failed)}"


def _still_in_flight(run_id) -> AgentRun | None:
    if run_id is None:
        return None
    run = AgentRun.objects.filter(pk=run_id).first()
    if run is None or run.status not in UNSETTLED:
        return None
    # A previous run whose worker died must not block the schedule for ever.
    if reconcile.reconcile_run_if_stale(run):
        return None
    return run


def fire_schedule(schedule_id: int, *, slot: datetime, now: datetime | None = None) -> ScheduleFiring | None:
    """Fire one due slot of a schedule; None if someone else already fired it (or it changed)."""
    now = now or timezone.now()
    with transaction.atomic():
        schedule = RunSchedule.objects.filter(pk=schedule_id, enabled=True, next_fire_at=slot).first()
        if schedule is None:
            return None
        following = next_slot(schedule, after=max(now, slot))
        claimed = RunSchedule.objects.filter(pk=schedule_id, enabled=True, next_fire_at=slot).update(
            next_fire_at=following, last_fired_at=now
        )
        if claimed != 1:
            return None
        blocking = _still_in_flight(schedule.last_run_id)
        if blocking is not None:
            reason = (
                f"The previous run {blocking.run_id} of this schedule was still {blocking.status}, so this "
                "firing was skipped rather than stacked."
            )
            RunSchedule.objects.filter(pk=schedule_id).update(last_skipped_at=now, last_skip_reason=reason)
            return ScheduleFiring.objects.create(
                schedule=schedule, slot=slot, fired_at=now, outcome=FiringOutcome.SKIPPED,
                blocking_run=blocking, detail=reason,
            )
        try:
            with transaction.atomic():
                run = services.start_run(
                    agent_name=schedule.agent_name,
                    message=schedule.message,
                    owner_id=schedule.owner_id,
                    params=schedule.params,
                    created_by=None,
                    trigger=Trigger.SCHEDULE,
                )
        except ValidationError as exc:
            detail = " ".join(m for messages in exc.message_dict.values() for m in messages)
            logger.warning("Schedule %s could not start its run: %s", schedule.name, detail)
            return ScheduleFiring.objects.create(
                schedule=schedule, slot=slot, fired_at=now, outcome=FiringOutcome.FAILED,
                detail=f"The run could not be started: {detail}",
            )
        RunSchedule.objects.filter(pk=schedule_id).update(last_run=run)
        return ScheduleFiring.objects.create(
            schedule=schedule, slot=slot, fired_at=now, outcome=FiringOutcome.STARTED, run=run
        )


def fire_due_schedules(*, now: datetime | None = None) -> FiringReport:
    """Fire every enabled schedule whose slot has come; safe to run twice, or in two places at once."""
    now = now or timezone.now()
    report = FiringReport()
    due = list(
        RunSchedule.objects.filter(enabled=True, next_fire_at__lte=now)
        .order_by("next_fire_at")
        .values_list("pk", "next_fire_at", "name")[:MAX_DUE_PER_TICK]
    )
    for schedule_id, slot, name in due:
        try:
            firing = fire_schedule(schedule_id, slot=slot, now=now)
        except Exception:  # noqa: BLE001 - one broken schedule must not stop the others
            logger.exception("Schedule %s: firing failed", name)
            report.failed.append(name)
            continue
        if firing is None:
            continue
        {
            FiringOutcome.STARTED: report.started,
            FiringOutcome.SKIPPED: report.skipped,
            FiringOutcome.FAILED: report.failed,
        }[firing.outcome].append(name)
    return report
