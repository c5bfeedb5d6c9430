"""Runs that die without saying goodbye.

A worker killed with SIGKILL (or a machine that loses power) never settles its run: the row
stays `running` forever. A run is *stale* when its heartbeat is older than
RUN_STALE_AFTER_SECONDS, or when it has no heartbeat and started more than
RUN_MAX_SILENCE_HOURS ago. Reconciling it sets it to `error`/`reconciled`, says when it was
last heard from, and records what the journal (or the session) proves it called.

Every write is conditional on the row still being `running` and still stale, under a row lock
(`SELECT … FOR UPDATE SKIP LOCKED`; SQLite's IMMEDIATE transactions serialise instead), so
any number of reconcilers (the periodic job on several clusters, reads of a run in several web
processes) land exactly once, a heartbeat that arrives in the meantime wins, and a worker
that finishes afterwards keeps its outcome in `late_outcome` (`lifecycle.settle_run`).

There is no "queued but lost" run: the run table is the queue (runs.worker.processes claims from it), so a
`queued` row is claimable until a worker claims it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import Q, QuerySet
from django.db.models.functions import Coalesce
from django.utils import timezone

from runs.ledger import journal
from runs.ledger.counters import RECONCILIATIONS
from runs.models.ledger import STREAMED_TRIGGERS, AgentRun, RunStatus

logger = logging.getLogger(__name__)

RECONCILED = "reconciled"
# Rows locked and rewritten per transaction: big enough to amortise the round trips, small
# enough that a sweep never holds many row locks for long.
CHUNK_SIZE = 200

# Only what reconciling needs; the candidate scan never reads a run's input or result.
_FIELDS = ("run_id", "agent_name", "owner_id", "session_id", "status", "heartbeat_at", "started_at", "created_at")


@dataclass(frozen=True)
class Cutoffs:
    now: datetime
    heartbeat_before: datetime
    silent_start_before: datetime

    @classmethod
    def at(cls, now: datetime | None = None) -> Cutoffs:
        now = now or timezone.now()
        return cls(
            now=now,
            heartbeat_before=now - timedelta(seconds=settings.RUN_STALE_AFTER_SECONDS),
            silent_start_before=now - timedelta(hours=settings.RUN_MAX_SILENCE_HOURS),
        )


def stale_q(cutoffs: Cutoffs) -> Q:
    """The stale rule as a filter. Each branch is a range on the (status, heartbeat_at) index."""
    by_heartbeat = Q(status=RunStatus.RUNNING, heartbeat_at__lt=cutoffs.heartbeat_before)
    never_heard = Q(status=RunStatus.RUNNING, heartbeat_at__isnull=True) & (
        Q(started_at__lt=cutoffs.silent_start_before)
        | Q(started_at__isnull=True, created_at__lt=cutoffs.silent_start_before)
    )
    return by_heartbeat | never_heard


def stale_runs(*, now: datetime | None = None, queryset: QuerySet[AgentRun] | None = None) -> QuerySet[AgentRun]:
    """Runs that are stale right now (what the admin filter "stale running" lists)."""
    base = queryset if queryset is not None else AgentRun.objects.all()
    return base.filter(stale_q(Cutoffs.at(now)))


def is_stale(run: AgentRun, *, now: datetime | None = None) -> bool:
    """The stale rule on an instance already in memory: no query."""
    if run.status != RunStatus.RUNNING:
        return False
    cutoffs = Cutoffs.at(now)
    if run.heartbeat_at is not None:
        return run.heartbeat_at < cutoffs.heartbeat_before
    started = run.started_at or run.created_at
    return started is not None and started < cutoffs.silent_start_before


def candidate_querysets(cutoffs: Cutoffs, queryset: QuerySet[AgentRun] | None = None) -> list[QuerySet]:
    """The two scans that find stale runs' ids through the (status, heartbeat_at) index.

    Two queries rather than one OR: each is a plain index range (heartbeat older than the
    cutoff; heartbeat null), so the cost is the number of stale rows, not the table size.
    """
    base = queryset if queryset is not None else AgentRun.objects.all()
    by_heartbeat = base.filter(status=RunStatus.RUNNING, heartbeat_at__lt=cutoffs.heartbeat_before)
    never_heard = (
        base.filter(status=RunStatus.RUNNING, heartbeat_at__isnull=True)
        .annotate(began=Coalesce("started_at", "created_at"))
        .filter(began__lt=cutoffs.silent_start_before)
    )
    return [
        by_heartbeat.order_by("heartbeat_at").values_list("run_id", flat=True),
        never_heard.order_by().values_list("run_id", flat=True),
    ]


def _stale_ids(cutoffs: Cutoffs, queryset: QuerySet[AgentRun] | None) -> list[uuid.UUID]:
    return [run_id for scan in candidate_querysets(cutoffs, queryset) for run_id in scan]


def _ago(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 2 * 3600:
        return f"{seconds // 60} min"
    if seconds < 2 * 86400:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    return f"{seconds // 86400} days"


def reconciled_message(run: AgentRun, *, now: datetime) -> str:
    if run.heartbeat_at is not None:
        heard = (
            f"Its worker{f' ({run.worker})' if run.worker else ''} was last heard from at "
            f"{run.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC ({_ago(now - run.heartbeat_at)} before it was "
            f"reconciled; RUN_STALE_AFTER_SECONDS={settings.RUN_STALE_AFTER_SECONDS})"
        )
    else:
        began = run.started_at or run.created_at
        heard = (
            f"It never sent a heartbeat; it started at {began:%Y-%m-%d %H:%M:%S} UTC "
            f"({_ago(now - began)} before it was reconciled; RUN_MAX_SILENCE_HOURS={settings.RUN_MAX_SILENCE_HOURS})"
        )
    return (
        f"No completion was recorded for this run. {heard}, and its worker is presumed dead. "
        "Its actual outcome is unknown: check what it called before running it again."
    )


def _tools_executed(run: AgentRun, *, isolated: bool) -> list[str] | None:
    if not isolated:
        return journal.derive_tools_executed(run)
    # In a savepoint: a failed read leaves the locking transaction usable and the run's tools
    # unknown, instead of aborting the whole chunk.
    try:
        with transaction.atomic():
            return journal.derive_tools_executed(run)
    except DatabaseError:
        logger.exception("Run %s: tools called could not be derived; left unknown", run.run_id)
        return None


def _reconcile_chunk(
    ids: list[uuid.UUID], cutoffs: Cutoffs, *, skip_locked: bool = True, isolated: bool = False
) -> list[AgentRun]:
    """Lock the rows that are still stale, write their verdict, return the ones this call landed.

    Rows another reconciler holds are skipped (it is reconciling them). The lock also makes a
    journal insert for the run wait (its foreign key takes a share lock on the run row), so
    the journal read below is complete.
    """
    with transaction.atomic():
        locked = list(
            AgentRun.objects.select_for_update(skip_locked=skip_locked)
            .filter(stale_q(cutoffs), pk__in=ids)
            .only(*_FIELDS, "worker")
        )
        landed: list[AgentRun] = []
        for run in locked:
            run.status = RunStatus.ERROR
            run.error_code = RECONCILED
            run.error_message = reconciled_message(run, now=cutoffs.now)
            # The journal (in-doubt `called` rows count as called), else the session, else null.
            run.tools_executed = _tools_executed(run, isolated=isolated)
            run.finished_at = cutoffs.now
            # The conditional UPDATE, one row at a time (cheaper than bulk_update's CASE
            # expressions, and it tells which rows landed). The lock already excludes other
            # reconcilers; the condition keeps the write honest where rows are not locked.
            if _write_reconciled(run, stale_q(cutoffs)):
                landed.append(run)
    return _reported(landed)


def _write_reconciled(run: AgentRun, condition: Q) -> bool:
    """Write `run`'s verdict if `condition` still holds for its row; whether it landed."""
    return bool(AgentRun.objects.filter(condition, pk=run.pk).update(
        status=run.status,
        error_code=run.error_code,
        error_message=run.error_message,
        tools_executed=run.tools_executed,
        finished_at=run.finished_at,
    ))


def _reported(landed: list[AgentRun]) -> list[AgentRun]:
    for run in landed:
        logger.warning("Run %s reconciled: %s", run.run_id, run.error_message)
    RECONCILIATIONS.inc(len(landed))
    return landed


def _reconcile_ids(ids: list[uuid.UUID], cutoffs: Cutoffs, *, skip_locked: bool = True) -> list[AgentRun]:
    try:
        return _reconcile_chunk(ids, cutoffs, skip_locked=skip_locked)
    except DatabaseError:
        # A journal or session read failed and (on PostgreSQL) took the transaction with it.
        # Again, with every read in its own savepoint (two more round trips per run, which is
        # why it is not the first attempt): runs whose tools cannot be read get them unknown.
        logger.warning("Reconciling %d run(s) again with isolated reads after a database error", len(ids))
        return _reconcile_chunk(ids, cutoffs, skip_locked=skip_locked, isolated=True)


# How a worker process's death was noticed (runs.worker.processes's parent, or runs.ledger.presence).
PARENT_SAW = "parent"
LOCK_GONE = "lock"


def dead_worker_message(run: AgentRun, *, worker: str, why: str = PARENT_SAW) -> str:
    noticed = (
        "and the process that started it noticed at once"
        if why == PARENT_SAW
        else "noticed at once by another worker: its database session (and the lock it held while alive) ended"
    )
    return (
        f"No completion was recorded for this run. Its worker process ({worker}) died while it ran, {noticed}. "
        "Its actual outcome is unknown: check what it called before running it again."
    )


def reconcile_dead_worker(*, worker: str, now: datetime | None = None, why: str = PARENT_SAW) -> list[AgentRun]:
    """Reconcile, now, the runs a worker process that is known to be dead still held.

    Its parent saw it die (`waitpid`), or its advisory lock is gone (runs.ledger.presence), so there is
    no need to wait for staleness.
    Each write is conditional on the run still being `running` under the lease that worker held
    (read under the same row lock), so a run that moved on meanwhile is left alone.
    """
    now = now or timezone.now()
    landed: list[AgentRun] = []
    with transaction.atomic():
        held = list(
            AgentRun.objects.select_for_update(skip_locked=True)
            .filter(status=RunStatus.RUNNING, worker=worker)
            .only(*_FIELDS, "worker", "lease")[:CHUNK_SIZE * 10]
        )
        for run in held:
            run.status = RunStatus.ERROR
            run.error_code = RECONCILED
            run.error_message = dead_worker_message(run, worker=worker, why=why)
            run.tools_executed = _tools_executed(run, isolated=True)
            run.finished_at = now
            if _write_reconciled(run, Q(status=RunStatus.RUNNING, lease=run.lease)):
                landed.append(run)
    return _reported(landed)


@dataclass
class SweepReport:
    reconciled: list[AgentRun] = field(default_factory=list)
    abandoned: int = 0

    def __str__(self) -> str:
        return f"{len(self.reconciled)} stale run(s) reconciled, {self.abandoned} abandoned chat turn(s) cancelled"


def reconcile_stale_runs(
    *,
    queryset: QuerySet[AgentRun] | None = None,
    now: datetime | None = None,
    on_reconciled: Callable[[AgentRun], None] | None = None,
) -> list[AgentRun]:
    """Reconcile every stale run (or every stale run of `queryset`); return those this call landed."""
    cutoffs = Cutoffs.at(now)
    ids = _stale_ids(cutoffs, queryset)
    landed: list[AgentRun] = []
    for start in range(0, len(ids), CHUNK_SIZE):
        for run in _reconcile_ids(ids[start : start + CHUNK_SIZE], cutoffs):
            landed.append(run)
            if on_reconciled is not None:
                on_reconciled(run)
    return landed


def reconcile_run_if_stale(run: AgentRun) -> bool:
    """Reconcile-on-read: call this before showing a run or deciding about it.

    Costs no query unless the instance in hand looks stale. Returns True if the run was
    reconciled now (by this call or by a concurrent reconciler); `run` is then refreshed.
    """
    if not is_stale(run):
        return False
    # A reader waits for a concurrent reconciler's lock (milliseconds) rather than showing a
    # verdict that is about to change.
    _reconcile_ids([run.pk], Cutoffs.at(), skip_locked=False)
    run.refresh_from_db()
    return run.status == RunStatus.ERROR and run.error_code == RECONCILED


ABANDONED_CHAT_MESSAGE = (
    "The chat server stopped before this turn started, so nothing was executed; its client "
    "has gone, so the turn was not handed to a worker."
)


def abandon_lost_chat_turns(*, now: datetime | None = None) -> int:
    """Cancel chat turns still `queued` after RUN_STALE_AFTER_SECONDS.

    A chat turn is executed by the server that streams it; if that server died before claiming
    it, running it later in a worker would act for a user who is no longer waiting. Nothing ran
    (it was never claimed), so its tools are checked and none. A turn queued again after it waited
    for a decision was claimed before: a worker continues it.
    """
    now = now or timezone.now()
    # The chat server claims its turn as soon as it wrote it: one still unclaimed this long after
    # had its server die, like a worker whose heartbeat went quiet.
    cutoff = now - timedelta(seconds=settings.RUN_STALE_AFTER_SECONDS)
    lost = AgentRun.objects.filter(
        status=RunStatus.QUEUED, trigger__in=STREAMED_TRIGGERS, attempts=0, created_at__lt=cutoff
    )
    return lost.update(
        status=RunStatus.CANCELLED,
        error_code="abandoned",
        error_message=ABANDONED_CHAT_MESSAGE,
        tools_executed=[],
        finished_at=now,
    )


def sweep(*, now: datetime | None = None, on_reconciled: Callable[[AgentRun], None] | None = None) -> SweepReport:
    """The periodic job (and every worker's sweep): reconcile stale runs, drop lost chat turns."""
    report = SweepReport()
    report.reconciled = reconcile_stale_runs(now=now, on_reconciled=on_reconciled)
    report.abandoned = abandon_lost_chat_turns(now=now)
    return report


def describe(runs: Iterable[AgentRun]) -> list[str]:
    lines = []
    for run in runs:
        tools = "unknown" if run.tools_executed is None else (", ".join(run.tools_executed) or "none")
        heard = run.heartbeat_at or run.started_at or run.created_at
        lines.append(f"{run.run_id} {run.agent_name} owner={run.owner_id} last heard {heard:%Y-%m-%d %H:%M:%S} UTC; tools called: {tools}")
    return lines
