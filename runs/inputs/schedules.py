"""When a user schedule fires: its kind, the cron check and the next slot. Pure: no queries.

The model applies `prepare_for_save` on every save, so a schedule made any way (the admin, the
shell, a fixture) has its first slot set and is never silently left without one.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Protocol

from croniter import croniter
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone

MAX_INTERVAL_MINUTES = 366 * 24 * 60


class ScheduleKind(models.TextChoices):
    INTERVAL = "interval", "every N minutes"
    CRON = "cron", "cron expression"


class Timed(Protocol):
    enabled: bool
    kind: str
    interval_minutes: int | None
    cron: str
    next_fire_at: datetime | None


def check_cron(expression: Any) -> str:
    if not isinstance(expression, str) or not expression.strip():
        raise ValidationError({"cron": "Give a cron expression, e.g. “0 7 * * 1-5” (07:00 on weekdays)."})
    expression = " ".join(expression.split())
    if len(expression.split(" ")) != 5:
        raise ValidationError(
            {"cron": f"“{expression}” is not a five-field cron expression (minute hour day month weekday)."}
        )
    if not croniter.is_valid(expression):
        raise ValidationError({"cron": f"“{expression}” is not a valid cron expression."})
    return expression


def next_slot(schedule: Timed, *, after: datetime) -> datetime:
    """The first slot strictly after `after`."""
    if schedule.kind == ScheduleKind.CRON:
        start = timezone.localtime(after)
        return croniter(schedule.cron, start).get_next(datetime)
    step = timedelta(minutes=schedule.interval_minutes)
    previous = schedule.next_fire_at
    if previous is None:
        return after + step
    # Keep the schedule on its own grid (no drift), skipping slots that were missed.
    missed = max(0, int((after - previous) // step) + 1)
    return previous + step * missed


def prepare_for_save(schedule: Timed, *, timing_changed: bool, now: datetime | None = None) -> None:
    """Set the first slot of a new or re-timed (or re-enabled) schedule; clear it when disabled."""
    now = now or timezone.now()
    if not schedule.enabled:
        schedule.next_fire_at = None
        return
    if timing_changed or schedule.next_fire_at is None:
        schedule.next_fire_at = None
        schedule.next_fire_at = next_slot(schedule, after=now)


