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

from django.db import transaction
from django.db.models import F
from django.utils import timezone
from django_q.tasks import async_task

from memory.services import remember_session
from runs import chain, journal
from runs.models import AgentRun, RunStatus
from runs.steps import settle_unfinished_steps

logger = logging.getLogger(__name__)


def enqueue_run(run_id: uuid.UUID) -> None:
    # No Success row per run: the run row is the record, and django-q2's monitor locks and reads
    # every kept success (save_limit) to prune one per saved task, a core's fifth at 10 runs/s.
    # A task that fails is still saved.
    async_task("runs.tasks.execute_run", str(run_id), task_name=f"run {run_id}", group="runs", save=False)


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def claim_run(*, run_id: uuid.UUID, worker: str) -> bool:
    """Move the run queued → running. False if anyone else got there first (or it was cancelled)."""
    now = timezone.now()
    claimed = AgentRun.objects.filter(pk=run_id, status=RunStatus.QUEUED).update(
        status=RunStatus.RUNNING,
        started_at=now,
        heartbeat_at=now,
        attempts=F("attempts") + 1,
        worker=worker,
    )
    return claimed == 1


def claim_and_load_run(*, run_id: uuid.UUID, worker: str) -> AgentRun | None:
    """Claim the run and read it back in one transaction; None if it was no longer queued."""
    with transaction.atomic():
        if not claim_run(run_id=run_id, worker=worker):
            return None
        return AgentRun.objects.get(pk=run_id)


def beat(*, run_id: uuid.UUID) -> bool:
    """Refresh the heartbeat; False once the run is no longer running (e.g. reconciled)."""
    return AgentRun.objects.filter(pk=run_id, status=RunStatus.RUNNING).update(heartbeat_at=timezone.now()) == 1


def beat_many(*, run_ids: list[uuid.UUID]) -> set[uuid.UUID]:
    """One process's heartbeat: refresh every run it holds in one statement per chunk.

    Returns the runs that asked to be cancelled, read in the same round of queries, so a
    process with a hundred runs costs two statements a beat, not two hundred.
    """
    now = timezone.now()
    cancel_requested: set[uuid.UUID] = set()
    for start in range(0, len(run_ids), BEAT_CHUNK):
        chunk = run_ids[start : start + BEAT_CHUNK]
        AgentRun.objects.filter(pk__in=chunk, status=RunStatus.RUNNING).update(heartbeat_at=now)
        cancel_requested.update(
            AgentRun.objects.filter(pk__in=chunk, cancel_requested_at__isnull=False).values_list("pk", flat=True)
        )
    return cancel_requested


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
    """Write the run's outcome if it is still `running`; otherwise keep it as a late outcome.

    `run` (the row as claimed) saves reading it again; only its identity fields are used.
    Returns True if this outcome became the run's status.
    """
    with transaction.atomic():
        if run is None:
            run = AgentRun.objects.get(pk=run_id)
        tools = journal.derive_tools_executed(run)
        now = timezone.now()
        settled = AgentRun.objects.filter(pk=run_id, status=RunStatus.RUNNING).update(
            status=status,
            error_code=error_code[:64],
            error_message=error_message,
            result=result,
            tools_executed=tools,
            finished_at=now,
        )
        if run.workflow:
            # Whatever verdict stands, the worker is done with the run's steps.
            settle_unfinished_steps(run_id=run_id)
        if settled:
            return True
        # Someone settled it first (a reconciler that thought the worker dead): record what the
        # worker saw without overwriting the first verdict.
        AgentRun.objects.filter(pk=run_id).update(
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

