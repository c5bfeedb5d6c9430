"""Leases: a run's writes belong to the attempt that holds it, and to no other.

A worker that looks dead may not be (a long pause, a frozen VM, a partition from the database):
its run is reconciled, maybe continued elsewhere, and then the old worker wakes up. Each claim
writes a fresh `lease` on the run; every write made on behalf of the run is conditional on the
run still being `running` under that lease, in the same statement or transaction:

- the ADK event append of the run's invocation, and so the journal row of each function call
  (`EventFence`, folded into the append's compare-and-set statement by `agents.session_store`:
  no extra round trip), so a zombie's tool never starts;
- the effect record before an idempotent tool acts, calls journaled outside the session,
  workflow steps, the settle and the heartbeat (`hold`, `held_q`).

A refused write raises `LeaseLost`, aborts the run in this process through ADK's abort signal
(`runs.execution.heartbeat`), writes nothing more for it, and is logged and counted.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from django.db import connections
from django.db.models import Exists, QuerySet
from google.adk.events.event import Event
from sqlalchemy import text
from sqlalchemy.sql.elements import TextClause

from runs.ledger.counters import LEASE_REFUSALS
from runs.models.ledger import AgentRun, RunStatus

logger = logging.getLogger(__name__)

# Beside `run_id` in RunConfig.custom_metadata, so every event of the invocation carries both.
LEASE_METADATA_KEY = "lease"
LEASE_LOST = "lease_lost"


class LeaseLost(RuntimeError):
    """The run is no longer held by this attempt (reconciled, settled, or claimed again)."""

    def __init__(self, run_id: uuid.UUID | str, what: str):
        self.run_id = run_id
        self.what = what
        super().__init__(
            f"Run {run_id} is no longer held by this worker (it was reconciled or settled elsewhere): "
            f"{what} was refused and nothing more is written for it."
        )


def lease_lost_of(exc: BaseException | None) -> LeaseLost | None:
    """The LeaseLost behind an error (ADK and SQLAlchemy may wrap it), if there is one."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LeaseLost):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def new_lease() -> uuid.UUID:
    return uuid.uuid4()


def held(*, run_id: Any, lease: uuid.UUID | None) -> QuerySet[AgentRun]:
    return AgentRun.objects.filter(pk=run_id, lease=lease, status=RunStatus.RUNNING)


def held_q(*, run_id: Any, lease: uuid.UUID | None) -> Exists:
    """A filter for a row of another table, true while the run is held: folds the check into a write."""
    return Exists(held(run_id=run_id, lease=lease))


def _abort_nothing(run_id: uuid.UUID) -> None:
    return None


# Set by runs.execution.heartbeat, which holds this process's runs (it imports this module, not the reverse).
_abort_in_process: list[Callable[[uuid.UUID], None]] = [_abort_nothing]


def abort_refused_runs_with(abort: Callable[[uuid.UUID], None]) -> None:
    _abort_in_process[0] = abort


def refuse(*, run_id: Any, what: str) -> LeaseLost:
    """Log and count a refused write, abort the run in this process; the error to raise."""
    LEASE_REFUSALS.labels(write=what).inc()
    logger.warning("Run %s: %s refused, the run is no longer held by this worker; aborting it", run_id, what)
    try:
        _abort_in_process[0](uuid.UUID(str(run_id)))
    except ValueError:
        pass
    return LeaseLost(run_id, what)


def hold(*, run_id: Any, lease: uuid.UUID | None, what: str) -> None:
    """Inside a transaction: lock the run's row if this lease still holds it, else refuse.

    The row lock (FOR NO KEY UPDATE; SQLite serialises writers anyway) keeps a reconciler from
    settling the run until this transaction commits, so what it writes is seen by the verdict.
    """
    if lease is None:
        return  # a run executed outside the ledger's claim (nothing to fence)
    found = list(held(run_id=run_id, lease=lease).select_for_update(no_key=True).values_list("pk", flat=True))
    if not found:
        raise refuse(run_id=run_id, what=what)


# --- The event append's fence ----------------------------------------------------------------------


def _db_uuid(value: Any) -> Any:
    field = AgentRun._meta.get_field("run_id")
    return field.get_db_prep_value(uuid.UUID(str(value)), connections["default"], prepared=False)


class EventFence:
    """`agents.session_sql`'s append fence: an event of a leased run is stored only while held.

    The condition joins the append's compare-and-set statement; FOR SHARE makes an append wait
    for a reconciler holding the run's row, then see its verdict (concurrent appends of one run
    share the lock).
    """

    def condition(self, dialect: str) -> TextClause:
        lock = " FOR SHARE" if dialect == "postgresql" else ""
        return text(
            "EXISTS (SELECT 1 FROM agent_runs WHERE run_id = :k_fence_run AND lease = :k_fence_lease "
            f"AND status = 'running'{lock})"
        )

    def params(self, event: Event) -> dict[str, Any] | None:
        metadata = event.custom_metadata or {}
        run_id, lease = metadata.get("run_id"), metadata.get(LEASE_METADATA_KEY)
        if not run_id or not lease:
            return None
        try:
            return {"k_fence_run": _db_uuid(run_id), "k_fence_lease": _db_uuid(lease)}
        except ValueError:
            return None

    def refused(self, event: Event) -> BaseException:
        what = "a function call's event" if event.get_function_calls() else "an event"
        return refuse(run_id=(event.custom_metadata or {}).get("run_id"), what=what)
