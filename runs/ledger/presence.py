"""Who is alive: a `runworker` process holds a session-level advisory lock while it lives (PostgreSQL).

The lock is taken on the process's listener connection (`runs.ledger.wakeup.Listener`) before it
claims anything, and PostgreSQL drops it the moment that connection ends: the process died, its
machine was lost, or the network between them went. So a run `running` under a `runworker`
name (`lifecycle.WORKER_SUFFIX`) whose lock nobody holds belongs to a process that is gone, and
any other process may reconcile it at once, conditional on the lease it was claimed under
(`runs.ledger.reconcile.reconcile_dead_worker`), instead of waiting RUN_STALE_AFTER_SECONDS.

If the connection dropped but the process lives on, its runs are reconciled all the same and it
is fenced by its leases (runs.ledger.leases): its next write for them is refused and they are aborted
there. The heartbeat's staleness stays the last line, for names without a lock (a chat server, a
`run_agent --inline`, SQLite) and for a lock taken by an unrelated name that hashes the same.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import connection

from runs.ledger import lifecycle
from runs.models.ledger import AgentRun, RunStatus

logger = logging.getLogger(__name__)

# The first key of every worker lock (the second is the hash of the worker's name): "ALWK".
LOCK_CLASS = 0x414C574B


def take(listener_connection: Any, worker: str) -> bool:
    """Take this process's lock on its listener connection; False if a live name hashes the same."""
    row = listener_connection.execute(
        "SELECT pg_try_advisory_lock(%s, hashtext(%s))", (LOCK_CLASS, worker)
    ).fetchone()
    return bool(row and row[0])


def alive_workers() -> int | None:
    """How many `runworker` processes hold their lock now (all machines); None on SQLite."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s::oid AND objsubid = 2 "
            "AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            [LOCK_CLASS],
        )
        return cursor.fetchone()[0]


def gone_workers(*, exclude: str = "") -> list[str]:
    """`runworker` names holding `running` runs whose lock nobody holds: their processes are gone."""
    if connection.vendor != "postgresql":
        return []
    names = [
        name
        for name in AgentRun.objects.filter(status=RunStatus.RUNNING, worker__endswith=lifecycle.WORKER_SUFFIX)
        .exclude(worker=exclude).values_list("worker", flat=True).distinct().order_by()
        if name
    ]
    if not names:
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name FROM unnest(%s::text[]) AS name WHERE NOT EXISTS (SELECT 1 FROM pg_locks WHERE "
            "locktype = 'advisory' AND classid = %s::oid AND objid = hashtext(name)::oid AND objsubid = 2 AND granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))",
            [names, LOCK_CLASS],
        )
        return [row[0] for row in cursor.fetchall()]
