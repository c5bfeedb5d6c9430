"""A user schedule's rules: its kind, the cron check, the next slot and what it may start. Pure: no queries.

The model applies `prepare_for_save` on every save, so a schedule made any way (the admin, the
shell, a fixture) has its first slot set and is never silently left without one; its `clean()`
asks `check_schedule`, the one check of every door.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Protocol

from croniter import croniter
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone

from runs.inputs import run_input

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


def check_schedule(schedule: Any) -> None:
    """Validate a schedule for every door (the admin form calls it through the model's clean())."""
    errors: dict[str, list[str]] = {}
    if schedule.params is None:  # an empty form field
        schedule.params = {}
    if schedule.kind == ScheduleKind.INTERVAL:
        minutes = schedule.interval_minutes
        if not isinstance(minutes, int) or not 1 <= minutes <= MAX_INTERVAL_MINUTES:
            errors["interval_minutes"] = [
                f"An interval schedule needs interval_minutes between 1 and {MAX_INTERVAL_MINUTES}."
            ]
        if schedule.cron:
            errors["cron"] = ["An interval schedule has no cron expression; choose the cron kind to use one."]
    elif schedule.kind == ScheduleKind.CRON:
        try:
            schedule.cron = check_cron(schedule.cron)
        except ValidationError as exc:
            errors.update(exc.message_dict)
        if schedule.interval_minutes:
            errors["interval_minutes"] = ["A cron schedule has no interval; leave interval_minutes empty."]
    else:
        errors["kind"] = [f"kind must be one of: {', '.join(ScheduleKind.values)}."]
    try:
        run_input.check_run_input(
            agent_name=schedule.agent_name,
            message=schedule.message,
            owner_id=schedule.owner_id,
            params=schedule.params,
        )
    except ValidationError as exc:
        for key, messages in exc.message_dict.items():
            errors.setdefault("agent_name" if key == "agent" else key, []).extend(messages)
    if errors:
        raise ValidationError(errors)
