"""Recovery without a person: a run that died is continued by the system when nothing needs one.

A run reconciled (its worker went silent or died) or aborted by a drain (`worker_shutdown`) has a
resume decision (`runs.rules.resume.decide_resume`) that already knows whether continuing it is safe:
nothing in doubt (every dangling call read only, answered by a done effect record, or none), the
agent unchanged, the session present. With `RUN_RECOVERY=resume` (the default) the system then
continues it as a resume (`resume_of`, trigger kept, `created_by` the chain's person,
`continued_by_system` set, `resume_reason` "recovered"), once the owner rule still lets that person act
for the run's owner (`runs.rules.owners.may_continue`); a run that died before its session held anything (killed just after its claim) is
started again instead, in a fresh session like a replay (`replay_of`, same reason). At most
`RUN_RECOVERY_ATTEMPTS` per chain, each later attempt after a backoff (`RUN_RECOVERY_BACKOFF_SECONDS`,
doubling). Otherwise the run waits on the desk for a person, and
`recovery` / `recovery_detail` on it say why (docs/architecture.md, "Recovery without a person").

Entry points: `recover` for one run (the death of a worker noticed by its runworker parent, a drain's aborted
runs), `recover_due` for the periodic sweep (runs reconciled on read or elsewhere, and attempts
whose backoff has elapsed). Both are idempotent: the original is locked while deciding, and a run
has one successor.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agents.models import AdkEvent
from runs.ledger import chain, outcomes, reconcile
from runs.ledger.counters import RECOVERIES
from runs.models.ledger import STREAMED_TRIGGERS, AgentRun, Recovery, RunStatus, ToolCall
from runs.refusals import OwnerNotPermitted, SessionGone
from runs.rules import owners
from runs.rules.resume import decide_resume, gather_resume_facts
from runs.services import run as services

logger = logging.getLogger(__name__)

RECOVERED = "recovered"
WORKER_SHUTDOWN = "worker_shutdown"
# The deaths the system may continue from: a reconciliation, a drain's abort, a run whose worker lost
# its database connection under it (a restart, pg_terminate_backend, a network fault).
RECOVERABLE_CODES = (reconcile.RECONCILED, WORKER_SHUTDOWN, outcomes.DATABASE_LOST)
# How far back the sweep looks for runs to continue: a run that died long ago is a person's.
HORIZON = timedelta(hours=1)


def enabled() -> bool:
    return settings.RUN_RECOVERY == "resume"


def delay_before(attempt: int) -> float:
    """Seconds after a death before the system's `attempt`-th continuation (0-based): at once, then doubling."""
    if attempt <= 0:
        return 0.0
    return settings.RUN_RECOVERY_BACKOFF_SECONDS * 2 ** (attempt - 1)


def _mark(run: AgentRun, state: str, detail: str) -> None:
    AgentRun.objects.filter(pk=run.pk).update(recovery=state, recovery_detail=detail)
    run.recovery, run.recovery_detail = state, detail


def recover(*, run_id: uuid.UUID, now: datetime | None = None) -> AgentRun | None:
    """Continue the run as a resume if the system may; None if it did not (the run says why)."""
    if not enabled():
        return None
    now = now or timezone.now()
    with transaction.atomic():
        run = AgentRun.objects.select_for_update().filter(pk=run_id).first()
        if (
            run is None
            or run.status != RunStatus.ERROR
            or run.error_code not in RECOVERABLE_CODES
            or run.recovery in (Recovery.RECOVERED, Recovery.NEEDS_PERSON, Recovery.EXHAUSTED)
            or run.resumes.exists()
            or run.replays.exists()
        ):
            return None
        if run.trigger in STREAMED_TRIGGERS:
            _mark(run, Recovery.NEEDS_PERSON, (
                "Not continued by the system: a chat turn's client was waiting for its answer and has gone. "
                "Resume it to continue the conversation."
            ))
            return None
        # The system's continuations of this chain so far (resumes, and fresh starts of runs that died
        # before they wrote anything).
        used = sum(1 for earlier in [run, *chain.predecessors(run)] if earlier.resume_reason == RECOVERED)
        attempts = settings.RUN_RECOVERY_ATTEMPTS
        if used >= attempts:
            _mark(run, Recovery.EXHAUSTED, (
                f"Not continued by the system: it already continued this run's chain {used} time(s) "
                f"(RUN_RECOVERY_ATTEMPTS={attempts}) and it died again. Check why before resuming it."
            ))
            return None
        due = (run.finished_at or now) + timedelta(seconds=delay_before(used))
        if due > now:
            if run.recovery != Recovery.PENDING:
                _mark(run, Recovery.PENDING, (
                    f"To be continued by the system after {delay_before(used):g} s "
                    f"(attempt {used + 1} of {attempts}, RUN_RECOVERY_BACKOFF_SECONDS)."
                ))
            return None
        if not owners.may_continue(run):
            _mark(run, Recovery.NEEDS_PERSON, (
                f"Not continued by the system ({OwnerNotPermitted.code}): the person who started it may no longer "
                f"act for owner {run.owner_id!r}."
            ))
            return None
        facts = gather_resume_facts(run)
        decision = decide_resume(run, facts=facts)
        if isinstance(decision.refusal, SessionGone) and _wrote_nothing(run):
            resumed = _start_afresh(run)
            _mark(run, Recovery.RECOVERED, (
                f"Started again by the system as run {resumed.run_id} (attempt {used + 1} of {attempts}): it died "
                "before it wrote anything, so nothing it did can be in doubt."
            ))
        elif decision.refusal is not None:
            _mark(run, Recovery.NEEDS_PERSON, (
                f"Not continued by the system ({decision.refusal.code}): {decision.refusal.detail}"
            ))
            return None
        else:
            resumed = services.write_queued_run(
                actor=None,
                on_behalf_of=run.created_by,
                **run.successor_fields(),
                resume_of=run,
                session_id=run.session_id,
                conversation_id=run.conversation_id,
                agent_fingerprint=facts.fingerprint_now,
                resume_reason=RECOVERED,
            )
            _mark(run, Recovery.RECOVERED, (
                f"Continued by the system as run {resumed.run_id} (attempt {used + 1} of {attempts}): nothing it "
                "did was in doubt."
            ))
    RECOVERIES.inc()
    logger.warning("Run %s (%s) continued by the system as run %s", run.run_id, run.error_code, resumed.run_id)
    return resumed


def _wrote_nothing(run: AgentRun) -> bool:
    """Whether the run died before its session held anything: not even its input, so no call either.

    A tool runs only after its call's event is stored (and journaled), so such a run did nothing. A
    workflow's steps are its own record: a workflow run is left to the resume rules. Its verdict must
    say it called nothing (not unknown).
    """
    if run.workflow or run.tools_executed != [] or ToolCall.objects.filter(run_id=run.run_id).exists():
        return False
    return not AdkEvent.objects.of_session(
        app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id
    ).exists()


def _start_afresh(run: AgentRun) -> AgentRun:
    """A run that wrote nothing has no conversation to continue: it starts again, as a replay would,
    in a fresh session (the one it was given is empty)."""
    return services.write_queued_run(
        actor=None,
        on_behalf_of=run.created_by,
        **run.successor_fields(),
        replay_of=run,
        session_id=str(uuid.uuid4()),
        resume_reason=RECOVERED,
    )


def recover_due(*, now: datetime | None = None) -> list[AgentRun]:
    """The sweep's part: every recent death not yet decided, and every attempt whose backoff elapsed."""
    if not enabled():
        return []
    now = now or timezone.now()
    candidates = list(
        AgentRun.objects.filter(
            status=RunStatus.ERROR,
            error_code__in=RECOVERABLE_CODES,
            recovery__in=["", Recovery.PENDING],
            finished_at__gte=now - HORIZON,
        ).values_list("run_id", flat=True)[:500]
    )
    recovered = []
    for run_id in candidates:
        resumed = recover(run_id=run_id, now=now)
        if resumed is not None:
            recovered.append(resumed)
    return recovered
