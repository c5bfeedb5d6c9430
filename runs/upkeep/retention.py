"""Retention: ADK session events older than EVENTS_RETENTION_DAYS are deleted in small batches.

What stays: every session row (its shell: id, owner, state), every event of a session that a
queued or running run still uses, every run row and the whole tool journal. The replay rules
read only the run row and the journal, so they never depend on a purged event.

Each batch is its own short transaction: a purge of millions of events never holds locks for
long, never bloats one transaction, and can be stopped at any point without losing progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet, Subquery
from django.utils import timezone

from agents.models import AdkEvent
from runs.models.ledger import UNSETTLED, AgentRun

# A batch deletes at most this many events: larger batches are long transactions again.
MAX_BATCH_SIZE = 100_000


class PurgeConfigError(ValueError):
    """A retention period or batch size that cannot be used; the message names it."""


@dataclass
class PurgeReport:
    cutoff: datetime
    dry_run: bool
    deleted: int = 0
    would_delete: int = 0
    batches: int = 0
    seconds: float = 0.0
    longest_batch_seconds: float = 0.0
    batch_seconds: list[float] = field(default_factory=list)

    @property
    def events_per_second(self) -> float:
        return self.deleted / self.seconds if self.seconds else 0.0

    def __str__(self) -> str:
        if self.dry_run:
            return (
                f"Dry run: {self.would_delete} event(s) older than {self.cutoff:%Y-%m-%d %H:%M:%S} UTC "
                "would be deleted; nothing was deleted."
            )
        return (
            f"Deleted {self.deleted} event(s) older than {self.cutoff:%Y-%m-%d %H:%M:%S} UTC in "
            f"{self.batches} batch(es) in {self.seconds:.2f} s (longest batch {self.longest_batch_seconds * 1000:.0f} ms). "
            "Sessions, runs and the tool journal were kept."
        )


def check_days(days: object, *, name: str = "days") -> int:
    if isinstance(days, bool) or not isinstance(days, int):
        raise PurgeConfigError(f"{name} must be a whole number of days, got {days!r}.")
    if days < 1:
        raise PurgeConfigError(
            f"{name} must be at least 1 (got {days}): a retention of {days} days would delete the events "
            "of runs that just finished."
        )
    return days


def check_batch_size(batch_size: object, *, name: str = "batch size") -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise PurgeConfigError(f"{name} must be a whole number of events, got {batch_size!r}.")
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise PurgeConfigError(
            f"{name} must be between 1 and {MAX_BATCH_SIZE} (got {batch_size}): each batch is one transaction "
            "and must stay short."
        )
    return batch_size


def purgeable_events(*, cutoff: datetime) -> QuerySet[AdkEvent]:
    """Events older than `cutoff`, except those of sessions a queued or running run uses.

    Matched on the session id alone (ids Agent Ledger generates): that protects at least every
    in-flight run's events, and it plans as one hashed `NOT IN` over the few in-flight runs
    instead of a join probed for every old event.
    """
    in_flight_sessions = AgentRun.objects.filter(status__in=UNSETTLED).values("session_id")
    return AdkEvent.objects.filter(timestamp__lt=cutoff).exclude(session_id__in=Subquery(in_flight_sessions))


def purge_events(
    *,
    days: int | None = None,
    batch_size: int | None = None,
    dry_run: bool = False,
    now: datetime | None = None,
    on_batch: Callable[[PurgeReport], None] | None = None,
) -> PurgeReport:
    """Delete events older than `days` (default EVENTS_RETENTION_DAYS), `batch_size` at a time.

    Raises PurgeConfigError for a period or batch size that cannot be used (the settings are
    checked too, in case they were changed at run time).
    """
    days = check_days(settings.EVENTS_RETENTION_DAYS if days is None else days,
                      name="days" if days is not None else "EVENTS_RETENTION_DAYS")
    batch_size = check_batch_size(settings.PURGE_BATCH_SIZE if batch_size is None else batch_size,
                                  name="batch size" if batch_size is not None else "PURGE_BATCH_SIZE")
    cutoff = (now or timezone.now()) - timedelta(days=days)
    report = PurgeReport(cutoff=cutoff, dry_run=dry_run)
    if dry_run:
        report.would_delete = purgeable_events(cutoff=cutoff).count()
        return report

    started = time.monotonic()
    while True:
        batch_started = time.monotonic()
        with transaction.atomic():
            # One statement per batch, oldest first along the timestamp index. The in-flight
            # check is made again for every batch: a run that starts on an old conversation
            # during a long purge protects its session from the next batch on.
            oldest = purgeable_events(cutoff=cutoff).order_by("timestamp").values("id")[:batch_size]
            deleted, _ = AdkEvent.objects.filter(id__in=Subquery(oldest), timestamp__lt=cutoff).delete()
        if not deleted:
            break
        elapsed = time.monotonic() - batch_started
        report.deleted += deleted
        report.batches += 1
        report.batch_seconds.append(elapsed)
        report.longest_batch_seconds = max(report.longest_batch_seconds, elapsed)
        report.seconds = time.monotonic() - started
        if on_batch is not None:
            on_batch(report)
        if deleted < batch_size:
            break
    report.seconds = time.monotonic() - started
    return report
