"""A run's life in its worker: claimed once, kept alive by heartbeats, settled exactly once.

Every write is conditional on the state it moves from, so a redelivered task, a reconciler and
a late worker can race without any of them overwriting another's verdict (docs/architecture.md,
"The life of a run").
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DatabaseError, connections, transaction
from django.db.models import F
from django.utils import timezone

from memory.services import remember_session
from runs.ledger import chain, journal, leases, wakeup
from runs.ledger.counters import RUNS_CLAIMED
from runs.ledger.steps import settle_unfinished_steps
from runs.models.ledger import STREAMED_TRIGGERS, AgentRun, RunStatus

logger = logging.getLogger(__name__)


def announce_run(run_id: uuid.UUID) -> None:
    """`run_id` was just made claimable (written `queued`): wake the workers at this transaction's commit.

    Called inside the transaction that wrote the row, so the notification and the row commit
    (or roll back) together. The row is the queue: a worker finds it by its next poll anyway.
    """
    wakeup.notify(wakeup.RUNS_CHANNEL)


def worker_name() -> str:
    """The name this process's claims carry: `WORKER_HOST:pid` (a `runworker` process adds WORKER_SUFFIX)."""
    if _process_role["runworker"]:
        return runworker_name(pid=os.getpid())
    return f"{worker_host()}:{os.getpid()}"


def runworker_name(*, pid: int) -> str:
    """The name of the claims of `runworker` process `pid` on this host (its parent reconciles by it)."""
    return f"{worker_host()}:{pid}{WORKER_SUFFIX}"


def worker_host() -> str:
    return settings.WORKER_HOST or socket.gethostname()


# Marks the claims of a `runworker` process, which holds its advisory lock while it lives
# (runs.ledger.presence): only such a name may be judged dead by the absence of its lock.
WORKER_SUFFIX = "/worker"
_process_role = {"runworker": False}


def become_runworker_process() -> None:
    _process_role["runworker"] = True


def claimable_runs():
    """Queued runs a worker may claim, oldest first (the `(status, created_at)` index).

    A chat turn (or a turn of ADK's wire, `STREAMED_TRIGGERS`) never claimed is its server's to run
    (it streams it); once it waited and was queued again (runs.ledger.approvals) it is a worker's like any run.
    """
    return (
        AgentRun.objects.filter(status=RunStatus.QUEUED)
        .exclude(trigger__in=STREAMED_TRIGGERS, attempts=0)
        .order_by("created_at")
    )


def claim_queued_runs(*, worker: str, limit: int) -> list[AgentRun]:
    """Claim up to `limit` claimable runs for `worker`, oldest first, each under a fresh lease.

    PostgreSQL: one statement, `WITH picked AS (SELECT … LIMIT :limit FOR UPDATE SKIP LOCKED)
    UPDATE … FROM picked RETURNING` every column, so concurrent workers split a backlog without waiting on
    each other and never take the same row. SQLite (one writer at a time): the same conditional
    claim (`claim_and_load_run`) over a few candidates.
    """
    if limit <= 0:
        return []
    connection = connections[AgentRun.objects.db]
    if connection.vendor != "postgresql":
        claimed: list[AgentRun] = []
        for run_id in claimable_runs().values_list("run_id", flat=True)[: limit * 2]:
            run = claim_and_load_run(run_id=run_id, worker=worker)
            if run is not None:
                claimed.append(run)
                if len(claimed) >= limit:
                    break
        RUNS_CLAIMED.inc(len(claimed))
        return claimed

    def quote(name: str) -> str:
        return connection.ops.quote_name(AgentRun._meta.get_field(name).column)

    table = connection.ops.quote_name(AgentRun._meta.db_table)
    now = AgentRun._meta.get_field("started_at").get_db_prep_save(timezone.now(), connection)
    # The candidates in a MATERIALIZED CTE, picked once: as `run_id IN (subquery)` the planner may
    # run the LIMITed subquery more than once and claim more rows than there are free slots.
    sql = (
        f"WITH picked AS MATERIALIZED (SELECT {quote('run_id')} FROM {table} WHERE {quote('status')} = %s "
        f"AND NOT ({quote('trigger')} IN ({', '.join(['%s'] * len(STREAMED_TRIGGERS))}) AND {quote('attempts')} = 0) "
        f"ORDER BY {quote('created_at')} LIMIT %s "
        f"FOR UPDATE SKIP LOCKED) "
        f"UPDATE {table} SET {quote('status')} = %s, {quote('started_at')} = %s, {quote('heartbeat_at')} = %s, "
        f"{quote('attempts')} = {quote('attempts')} + 1, {quote('worker')} = %s, {quote('lease')} = gen_random_uuid() "
        f"FROM picked WHERE {table}.{quote('run_id')} = picked.{quote('run_id')} AND {table}.{quote('status')} = %s "
        f"RETURNING {', '.join(f'{table}.{connection.ops.quote_name(field.column)}' for field in AgentRun._meta.concrete_fields)}"
    )
    params = [
        RunStatus.QUEUED.value, *(trigger.value for trigger in STREAMED_TRIGGERS), limit,
        RunStatus.RUNNING.value, now, now, worker, RunStatus.QUEUED.value,
    ]
    claimed = list(AgentRun.objects.raw(sql, params))
    RUNS_CLAIMED.inc(len(claimed))
    return claimed


def claim_run(*, run_id: uuid.UUID, worker: str) -> bool:
    """Move the run queued → running under a fresh lease. False if anyone else got there first
    (or it was cancelled)."""
    now = timezone.now()
    claimed = AgentRun.objects.filter(pk=run_id, status=RunStatus.QUEUED).update(
        status=RunStatus.RUNNING,
        started_at=now,
        heartbeat_at=now,
        attempts=F("attempts") + 1,
        worker=worker,
        lease=leases.new_lease(),
    )
    return claimed == 1


def claim_and_load_run(*, run_id: uuid.UUID, worker: str) -> AgentRun | None:
    """Claim the run and read it back in one statement; None if it was no longer queued.

    `UPDATE … WHERE status = 'queued' RETURNING` every column: the same conditional write as
    `claim_run`, and the row as claimed, in one round trip and one commit (PostgreSQL, and SQLite
    from 3.35). Django's `update()` returns only a count, hence the SQL.
    """
    connection = connections[AgentRun.objects.db]
    fields = AgentRun._meta.concrete_fields

    def quote(name: str) -> str:
        return connection.ops.quote_name(AgentRun._meta.get_field(name).column)

    def value(name: str, raw: object) -> object:
        return AgentRun._meta.get_field(name).get_db_prep_save(raw, connection)

    now = timezone.now()
    sql = (
        f"UPDATE {connection.ops.quote_name(AgentRun._meta.db_table)} SET {quote('status')} = %s, {quote('started_at')} = %s, "
        f"{quote('heartbeat_at')} = %s, {quote('attempts')} = {quote('attempts')} + 1, {quote('worker')} = %s, "
        f"{quote('lease')} = %s WHERE {quote('run_id')} = %s AND {quote('status')} = %s "
        f"RETURNING {', '.join(connection.ops.quote_name(field.column) for field in fields)}"
    )
    params = [
        RunStatus.RUNNING.value, value("started_at", now), value("heartbeat_at", now), worker,
        value("lease", leases.new_lease()), value("run_id", run_id), RunStatus.QUEUED.value,
    ]
    claimed = list(AgentRun.objects.raw(sql, params))
    return claimed[0] if claimed else None


def beat(*, run_id: uuid.UUID) -> bool:
    """Refresh the heartbeat; False once the run is no longer running (e.g. reconciled)."""
    return AgentRun.objects.filter(pk=run_id, status=RunStatus.RUNNING).update(heartbeat_at=timezone.now()) == 1


@dataclass
class Beat:
    """What one heartbeat learnt: runs that asked to be cancelled, runs this process no longer holds."""

    cancel_requested: set[uuid.UUID] = field(default_factory=set)
    lost: set[uuid.UUID] = field(default_factory=set)


def beat_many(*, held: dict[uuid.UUID, uuid.UUID | None]) -> Beat:
    """One process's heartbeat: refresh every run it holds (run id → lease) in one statement per chunk.

    Only a run still `running` under the lease this process holds is refreshed (a lease is a
    fresh id per claim, so `lease IN (…)` names the attempts exactly). The cancel requests and
    the runs no longer held come back in the same round of queries, so a process with a hundred
    runs costs two statements a beat, not two hundred.
    """
    now = timezone.now()
    beat = Beat()
    run_ids = list(held)
    for start in range(0, len(run_ids), BEAT_CHUNK):
        chunk = run_ids[start : start + BEAT_CHUNK]
        AgentRun.objects.filter(
            pk__in=chunk, lease__in=[held[run_id] for run_id in chunk], status=RunStatus.RUNNING
        ).update(heartbeat_at=now)
        found = {
            run_id: (status, lease, cancel_requested_at)
            for run_id, status, lease, cancel_requested_at in AgentRun.objects.filter(pk__in=chunk).values_list(
                "pk", "status", "lease", "cancel_requested_at"
            )
        }
        for run_id, (status, lease, cancel_requested_at) in found.items():
            if status != RunStatus.RUNNING or lease != held[run_id]:
                beat.lost.add(run_id)
            elif cancel_requested_at is not None:
                beat.cancel_requested.add(run_id)
    return beat


# Ids per heartbeat statement: far below any driver's parameter limit (SQLite's is 32766).
BEAT_CHUNK = 1000


def settle_run(
    *,
    run_id: uuid.UUID,
    status: str,
    error_code: str = "",
    error_message: str = "",
    result: str = "",
    run: AgentRun | None = None,
) -> bool:
    """Write the run's outcome if it is still `running` under the lease it was claimed with;
    otherwise keep it as a late outcome.

    `run` (the row as claimed) saves reading it again; its identity fields and lease are used.
    Returns True if this outcome became the run's status.
    """
    # No savepoint: inside the worker's transaction (with the memories it feeds) a failure here
    # fails the whole commit anyway, and alone this is the outermost block.
    with transaction.atomic(savepoint=False):
        if run is None:
            run = AgentRun.objects.get(pk=run_id)
        now = timezone.now()
        outcome = {
            "status": status,
            "error_code": error_code[:64],
            "error_message": error_message,
            "result": result,
            "finished_at": now,
        }
        # A journal with rows is the truth (journal.derive_tools_executed): the UPDATE itself
        # reads it, so a run that called tools settles in one statement.
        try:
            settled = (
                leases.held(run_id=run_id, lease=run.lease)
                .filter(journal.has_journal(run_id))
                .update(**outcome, tools_executed=journal.journal_tools_sql())
            )
            journal_read = True
        except DatabaseError:
            logger.exception("Run %s: the tool journal could not be read", run_id)
            settled, journal_read = 0, False
        if not settled and not journal_read:
            settled = leases.held(run_id=run_id, lease=run.lease).update(
                **outcome, tools_executed=journal.derive_tools_executed(run)
            )
        elif not settled:
            # No journal rows, or no longer held (then this matches nothing either, and the late
            # outcome below reads the journal): the session is the evidence.
            settled = leases.held(run_id=run_id, lease=run.lease).update(
                **outcome, tools_executed=journal.tools_without_journal(run)
            )
        if run.workflow:
            # Whatever verdict stands, the worker is done with the run's steps.
            settle_unfinished_steps(run_id=run_id)
        if settled:
            return True
        tools = journal.derive_tools_executed(run)
        # Someone settled it first (a reconciler that thought the worker dead): record what the
        # worker saw without overwriting the first verdict (and only on the attempt it held).
        AgentRun.objects.filter(pk=run_id, lease=run.lease).update(
            late_outcome={
                "status": status,
                "error_code": error_code,
                "error_message": error_message,
                "result": result,
                "tools_executed": tools,
                "finished_at": now.isoformat(),
            }
        )
    logger.warning("Run %s finished as %s after it had already been settled", run_id, status)
    return False


def remember_run(*, run_id: uuid.UUID) -> int:
    """Feed a successful run's conversation to the long-term memory of its (agent, owner).

    Idempotent; a run that did not succeed is not remembered (what it said may be wrong).
    """
    run = AgentRun.objects.get(pk=run_id)
    if run.status != RunStatus.SUCCESS:
        return 0
    added = remember_session(
        agent=run.agent_name, owner_id=run.owner_id, session_id=run.session_id,
        invocation_id=run.invocation_id, run_id=run.run_id,
    )
    return added + remember_predecessors(run)


def remember_predecessors(run: AgentRun) -> int:
    """A successful resume's conversation began in the runs it resumes: their turns are remembered too.

    Each invocation's events under its own run id; idempotent like every remembering.
    """
    added = 0
    for current in chain.predecessors(run, via=chain.RESUMES):
        added += remember_session(
            agent=current.agent_name, owner_id=current.owner_id, session_id=current.session_id,
            invocation_id=current.invocation_id, run_id=current.run_id,
        )
    return added

