"""A person's decisions on a run's calls, and the system's when nobody answers in time.

- **A call that waits** (docs/architecture.md, "Approvals and tools that wait"): `decide_call`
  (approve or reject, a note, a payload where the tool asks for one; `runs.approve_toolcall`) and
  `give_result` (a long-running call's answer; `runs.answer_toolcall` and the owner rule; both asked
  in `runs.rules.permissions`) lock the call's row, take the answer once and, in the same
  transaction, when the run waits for nothing more, move it `waiting → queued`. `expire_waiting`
  (a periodic job) rejects what has waited past `APPROVAL_TIMEOUT_SECONDS`, with the system's reason.
- **A call in doubt** (docs/architecture.md, "Effects"): `settle_call` records who, when and why, and
  marks the call's effect record done or failed; the run's outcome is untouched.

What a run leaves waiting, parking it and the continuation are the record's (`runs.ledger.approvals`);
effect records at call time are `runs.ledger.effects`.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.admin.models import CHANGE, LogEntry
from django.db import transaction
from django.utils import timezone

from config.lib.refusals import required_text
from config.lib.safe_json import UnsafeInput, check_value
from config.lib.text import hidden_character
from runs.ledger import lifecycle, reconcile
from runs.ledger.approvals import mark_never_ran
from runs.ledger.effects import SUMMARY_MAX_CHARS, doubt_of, owned_record
from runs.models.approvals import Decision, PendingCall, WaitKind
from runs.models.effects import EffectStatus, ToolEffect
from runs.models.ledger import AgentRun, RunStatus, SettledOutcome, ToolCall
from runs.refusals import (
    AlreadyDecided,
    CallNotFound,
    NoteHasHiddenCharacters,
    NoteRequired,
    NoteTooLong,
    NotInDoubt,
    NotWaitingFor,
    PayloadNotAllowed,
    UnknownDecision,
    UnknownOutcome,
    WrongAnswerKind,
)
from runs.rules import permissions, visibility

logger = logging.getLogger(__name__)


NOTE_MAX_CHARS = 2000


TIMEOUT_CHUNK = 200


def _note(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise PayloadNotAllowed("note must be text.")
    text = value.strip()
    if len(text) > NOTE_MAX_CHARS:
        raise NoteTooLong(NOTE_MAX_CHARS)
    # Read by the next person on the run page, as a settle note is: the same rule.
    if (problem := hidden_character(text)) is not None:
        raise NoteHasHiddenCharacters(problem)
    return text


def _checked_payload(value: Any) -> Any:
    try:
        check_value(value, where="payload")
    except UnsafeInput as exc:
        raise PayloadNotAllowed(f"The payload cannot be stored: {exc}") from None
    return value


def _locked_call(*, run_id: Any, call_id: str, actor: Any) -> tuple[AgentRun, PendingCall]:
    """The run (visible to the actor) and its waiting call, both locked until the transaction ends."""
    run = visibility.get_visible_run(run_id, actor=actor, lock=True)
    pending = PendingCall.objects.select_for_update().filter(run_id=run.run_id, call_id=str(call_id)[:128]).first()
    if pending is None:
        raise NotWaitingFor(run.run_id, call_id)
    if pending.decision:
        who = "the system" if pending.by_system else (pending.decided_by.get_username() if pending.decided_by else "someone")
        raise AlreadyDecided(pending.call_id, pending.get_decision_display(), who,
                             pending.decided_at.isoformat() if pending.decided_at else "")
    return run, pending


def _record(pending: PendingCall, *, decision: str, actor: Any, note: str, payload: Any, by_system: bool = False) -> None:
    # Conditional on the call still being open: with the row lock held this always lands, and it
    # keeps a second writer that slipped past the lock (a database without row locks) from overwriting.
    now = timezone.now()
    user = actor if getattr(actor, "is_authenticated", False) else None
    taken = PendingCall.objects.filter(pk=pending.pk, decision="").update(
        decision=decision, decided_by=user, decided_at=now, note=note, payload=payload, by_system=by_system
    )
    if taken != 1:
        pending.refresh_from_db()
        raise AlreadyDecided(pending.call_id, pending.get_decision_display(), "someone else",
                             pending.decided_at.isoformat() if pending.decided_at else "")
    pending.decision, pending.decided_by, pending.decided_at = decision, user, now
    pending.note, pending.payload, pending.by_system = note, payload, by_system
    if decision == Decision.REJECT:
        who = "the approval timeout" if by_system else (user.get_username() if user else "a person")
        mark_never_ran(run_id=pending.run_id, call_ids=[pending.call_id], why=f"rejected by {who}: not run")


def _continue_if_answered(run: AgentRun) -> bool:
    """Queue the run again once it waits for nothing more; the workers are told when the answer commits."""
    if PendingCall.objects.filter(run_id=run.run_id, decision="").exists():
        return False
    queued = AgentRun.objects.filter(pk=run.run_id, status=RunStatus.WAITING).update(status=RunStatus.QUEUED)
    if queued:
        lifecycle.announce_run(run.run_id)
    return bool(queued)


def decide_call(*, run_id: Any, call_id: str, actor: Any, decision: Any, note: Any = "", payload: Any = None) -> PendingCall:
    """A person approves or rejects a call that waits for confirmation; the run goes on once all are answered."""
    if not permissions.may_approve(user=actor):
        # Who may see the run is asked first: a run one cannot see is not found, whatever one may do.
        visibility.get_visible_run(run_id, actor=actor)
        permissions.check_may_approve(actor=actor)
    if decision not in (Decision.APPROVE, Decision.REJECT):
        raise UnknownDecision(decision)
    note_text = _note(note)
    payload = _checked_payload(payload)
    with transaction.atomic():
        run, pending = _locked_call(run_id=run_id, call_id=call_id, actor=actor)
        permissions.check_may_approve(actor=actor, run=run)
        if pending.kind != WaitKind.CONFIRMATION:
            raise WrongAnswerKind(pending.call_id, "its tool's result", "result")
        if payload is not None and decision == Decision.REJECT:
            raise PayloadNotAllowed("A rejection carries no payload: the tool does not run.")
        _record(pending, decision=decision, actor=actor, note=note_text, payload=payload)
        _continue_if_answered(run)
    logger.info("Call %s of run %s %s by %s", pending.call_id, run.run_id, pending.get_decision_display(), actor)
    return pending


def give_result(*, run_id: Any, call_id: str, actor: Any, result: Any, note: Any = "") -> PendingCall:
    """An external system (or a person) gives a long-running call its answer; the run goes on with it."""
    if not permissions.may_answer(user=actor):
        visibility.get_visible_run(run_id, actor=actor)
        permissions.check_may_answer(actor=actor)
    note_text = _note(note)
    result = _checked_payload(result)
    with transaction.atomic():
        run, pending = _locked_call(run_id=run_id, call_id=call_id, actor=actor)
        permissions.check_may_answer(actor=actor, run=run)
        if pending.kind != WaitKind.RESULT:
            raise WrongAnswerKind(pending.call_id, "a person's approval", "decision")
        _record(pending, decision=Decision.RESULT, actor=actor, note=note_text, payload=result)
        _continue_if_answered(run)
    logger.info("Call %s of run %s answered by %s", pending.call_id, run.run_id, actor)
    return pending


def timeout_reason() -> str:
    hours = settings.APPROVAL_TIMEOUT_SECONDS / 3600
    return (
        f"Nobody answered within APPROVAL_TIMEOUT_SECONDS={settings.APPROVAL_TIMEOUT_SECONDS} "
        f"({hours:g} h), so the system rejected it."
    )


def expire_waiting(*, now: Any = None) -> int:
    """Reject every call that has waited past APPROVAL_TIMEOUT_SECONDS; its run goes on as on a rejection.

    A long-running call that times out is answered with an error saying so. Idempotent: a call
    answered meanwhile is skipped (the row lock and the open-call condition), so two sweeps land once.
    """
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.APPROVAL_TIMEOUT_SECONDS)
    expired = 0
    due = list(
        PendingCall.objects.filter(decision="", asked_at__lt=cutoff).order_by("asked_at").values_list("pk", flat=True)[
            :TIMEOUT_CHUNK * 10
        ]
    )
    reason = timeout_reason()
    for pk in due:
        with transaction.atomic():
            pending = PendingCall.objects.select_for_update(skip_locked=True).filter(pk=pk, decision="").first()
            if pending is None:
                continue
            run = AgentRun.objects.select_for_update().get(pk=pending.run_id)
            if pending.kind == WaitKind.CONFIRMATION:
                _record(pending, decision=Decision.REJECT, actor=None, note=reason, payload=None, by_system=True)
            else:
                _record(pending, decision=Decision.RESULT, actor=None, note=reason,
                        payload={"error": f"No result arrived in time. {reason}"}, by_system=True)
            _continue_if_answered(run)
            expired += 1
    if expired:
        logger.info("%d waiting call(s) timed out", expired)
    return expired


MAX_NOTE_CHARS = 2000


def check_note(note: Any) -> str:
    text = required_text(note, limit=MAX_NOTE_CHARS, missing=NoteRequired, too_long=NoteTooLong)
    problem = hidden_character(text)
    if problem is not None:
        raise NoteHasHiddenCharacters(problem)
    return text


def _not_in_doubt_reason(run: AgentRun, call: ToolCall) -> str:
    if run.is_in_flight:
        return f"its run is still {run.status}."
    if call.settled_outcome:
        who = call.settled_by.get_username() if call.settled_by else "someone"
        return f"{who} already settled it as {call.settled_outcome} at {call.settled_at:%Y-%m-%d %H:%M:%S} UTC."
    return f"it is {call.status}, so what it did is known."


def settle_call(*, run_id: Any, call_id: str, actor: Any, outcome: Any, note: Any) -> ToolCall:
    """A person's word on a call in doubt: recorded with who, when and why; the run's outcome is untouched.

    `done` marks the call's effect record done (a replay reuses it); `not_done` marks it failed
    (a replay may run it). The replay rules read the settlement from the journal.
    """
    permissions.check_may_settle(actor=actor)
    if outcome not in SettledOutcome.values:
        raise UnknownOutcome(outcome)
    note = check_note(note)
    now = timezone.now()
    with transaction.atomic():
        run = visibility.get_visible_run(run_id, actor=actor, lock=True)
        reconcile.reconcile_run_if_stale(run)
        call = ToolCall.objects.select_for_update().filter(run=run, call_id=call_id).first()
        if call is None:
            raise CallNotFound(run_id, call_id)
        record = owned_record(call)
        if not doubt_of(run, call, record):
            raise NotInDoubt(call_id, _not_in_doubt_reason(run, call))
        # Conditional on still being unsettled: two people settling at once land once.
        settled = ToolCall.objects.filter(pk=call.pk, settled_outcome="").update(
            settled_outcome=outcome, settled_by=actor, settled_at=now, settle_note=note
        )
        if not settled:
            call.refresh_from_db()
            raise NotInDoubt(call_id, _not_in_doubt_reason(run, call))
        if record is not None:
            done = outcome == SettledOutcome.DONE
            ToolEffect.objects.filter(pk=record.pk, status=EffectStatus.STARTED).update(
                status=EffectStatus.DONE if done else EffectStatus.FAILED,
                finished_at=now,
                # What a repeat is served in place of the answer the tool never gave.
                result=record.result if record.result is not None or not done else {
                    "status": "done", "settled_by_person": True, "note": note,
                },
                error=f"Settled {outcome} by {actor.get_username()}: {note}"[:SUMMARY_MAX_CHARS],
            )
        LogEntry.objects.log_actions(
            actor.pk,
            [run],
            CHANGE,
            f"Settled call {call_id} ({call.tool_name}) as {outcome}. Note: {note}",
            single_object=True,
        )
    call.refresh_from_db()
    logger.info("Run %s: call %s settled %s by %s", run.run_id, call_id, outcome, actor)
    return call
