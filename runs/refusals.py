"""The run ledger's refusals: one branch of the family in `config.lib.refusals`.

A replay refusal is either final (nobody can fix it by forcing: the run or a replay is in
flight, the input is gone) or `forceable`: a person with the permission may set it aside with a
reason. Forceable refusals keep their core `sentence`, so each door adds its own hint for what
to do next (the API's `force=true`, the admin's “Force replay…”, the inbox's “Force reprocess…”)
instead of rewriting another door's words.
"""

from __future__ import annotations

from typing import Any

from config.lib.refusals import Refusal

API_FORCE_HINT = "Pass force=true to run it again anyway."
ADMIN_FORCE_HINT = "Use “Force replay…” to run it again anyway."


class RunNotFound(Refusal):
    """The run does not exist, or the actor may not see it (said the same way on purpose)."""

    status = 404
    code = "not_found"

    def __init__(self, run_id: Any):
        super().__init__(f"There is no run {run_id} that you can see.", run_id=str(run_id))


# --- Replay refusals (checked in the order of docs/architecture.md, "Replay rules") -----------------


class ReplayRefused(Refusal):
    """A refusal of `runs.rules.replay.decide`."""

    forceable = False

    def __init__(self, sentence: str, **context: Any):
        self.sentence = sentence
        if self.forceable:
            super().__init__(f"{sentence} {API_FORCE_HINT}", admin_detail=f"{sentence} {ADMIN_FORCE_HINT}", **context)
        else:
            super().__init__(sentence, **context)

    def worded(self, hint: str) -> str:
        """The refusal with another door's hint for what to do next."""
        return f"{self.sentence} {hint}" if self.forceable else self.sentence


class RunInFlight(ReplayRefused):
    status = 409
    code = "run_in_flight"


class RunWaiting(ReplayRefused):
    """The run waits for a person's decision or a long-running call's result (runs.ledger.approvals)."""

    status = 409
    code = "run_waiting"


class ReplayInFlight(ReplayRefused):
    status = 409
    code = "replay_in_flight"


class ResumeInFlight(ReplayRefused):
    """A resume of the run (runs.rules.resume) is still continuing it in its session."""

    status = 409
    code = "resume_in_flight"


class AlreadyResumed(ReplayRefused):
    status = 409
    code = "already_resumed"
    forceable = True


class InputGone(ReplayRefused):
    status = 410
    code = "input_gone"


class RunSucceeded(ReplayRefused):
    status = 409
    code = "run_succeeded"
    forceable = True


class AlreadyReplayed(ReplayRefused):
    status = 409
    code = "already_replayed"
    forceable = True


class ToolsCalled(ReplayRefused):
    status = 409
    code = "tools_called"
    forceable = True


class ToolsUnknown(ReplayRefused):
    status = 409
    code = "tools_unknown"
    forceable = True


class CallsInDoubt(ReplayRefused):
    """A call that acts was made and never answered: only a person (settling it) or force moves on."""

    status = 409
    code = "calls_in_doubt"
    forceable = True


# --- Forcing -------------------------------------------------------------------------------------


class ForceNotPermitted(Refusal):
    status = 403
    code = "force_not_permitted"

    def __init__(self) -> None:
        super().__init__(
            "Forcing a replay needs the permission “Can force a replay that the rules refuse” "
            "(runs.force_replay_agentrun); ask someone who has it."
        )


class ReasonRequired(Refusal):
    status = 400
    code = "reason_required"

    def __init__(self) -> None:
        super().__init__(
            "A forced replay needs a reason: say why running it again is acceptable.",
            admin_detail="Give a reason: say why doing this again is acceptable.",
        )


class ReasonTooLong(Refusal):
    status = 400
    code = "reason_too_long"

    def __init__(self, limit: int):
        super().__init__(f"The reason is longer than {limit} characters; say it in fewer words.", limit=limit)


# --- Cancellation --------------------------------------------------------------------------------


class RunAlreadySettled(Refusal):
    status = 409
    code = "run_settled"

    def __init__(self, status: str):
        super().__init__(
            f"This run already finished as {status}: there is nothing left to cancel.", status=status
        )


# --- Effects: a forced replay's choice, settling a call in doubt --------------------------------------


class RedoNeedsForce(Refusal):
    status = 400
    code = "redo_needs_force"

    def __init__(self) -> None:
        super().__init__(
            "Redoing recorded effects (effects=redo) sends emails and writes notes again: it is a forced "
            "replay. Pass force=true with a reason, or leave effects at reuse."
        )


class UnknownEffectsChoice(Refusal):
    status = 400
    code = "unknown_effects_choice"

    def __init__(self, value: Any):
        super().__init__(f"effects must be reuse or redo, not {value!r}.", effects=str(value))


class CallNotFound(Refusal):
    status = 404
    code = "not_found"

    def __init__(self, run_id: Any, call_id: Any):
        super().__init__(
            f"Run {run_id} has no tool call {call_id}.", run_id=str(run_id), call_id=str(call_id)
        )


class SettleNotPermitted(Refusal):
    status = 403
    code = "settle_not_permitted"

    def __init__(self) -> None:
        super().__init__(
            "Settling a call in doubt needs the permission “Can settle a tool call in doubt” "
            "(runs.settle_toolcall); ask someone who has it."
        )


class NoteRequired(Refusal):
    status = 400
    code = "note_required"

    def __init__(self) -> None:
        super().__init__(
            "Settling a call needs a note: say how you know whether it acted (e.g. what the outbox shows)."
        )


class NoteTooLong(Refusal):
    status = 400
    code = "note_too_long"

    def __init__(self, limit: int):
        super().__init__(f"The note is longer than {limit} characters; say it in fewer words.", limit=limit)


class NoteHasHiddenCharacters(Refusal):
    status = 400
    code = "note_invalid"

    def __init__(self, problem: str):
        super().__init__(
            f"The note contains {problem}; write it in plain text (line breaks and tabs are fine)."
        )


class ReasonHasHiddenCharacters(Refusal):
    status = 400
    code = "reason_invalid"

    def __init__(self, problem: str):
        super().__init__(
            f"The reason contains {problem}; write it in plain text (line breaks and tabs are fine)."
        )


class UnknownOutcome(Refusal):
    status = 400
    code = "unknown_outcome"

    def __init__(self, value: Any):
        super().__init__(f"outcome must be done or not_done, not {value!r}.", outcome=str(value))


class NotInDoubt(Refusal):
    status = 409
    code = "not_in_doubt"

    def __init__(self, call_id: str, why: str):
        super().__init__(f"Call {call_id} is not in doubt: {why} There is nothing to settle.", call_id=call_id)


# --- Who may act for whom (docs/architecture.md, "Who may act for whom") ----------------------------


class OwnerNotPermitted(Refusal):
    status = 403
    code = "owner_not_permitted"

    def __init__(self, owner_id: str):
        super().__init__(
            f"You may not act for owner {owner_id!r}. A user acts only for their own username, for an owner "
            "an admin granted them (Owner grants in the admin), or for any owner with the permission "
            "“Can start runs, chat and read memory for any owner” (runs.act_for_any_owner).",
            owner_id=owner_id,
        )


class ReplayNotPermitted(Refusal):
    status = 403
    code = "replay_not_permitted"

    def __init__(self, run_id: Any):
        super().__init__(
            f"Run {run_id} was started by someone else: replaying it needs the permission “Can replay another "
            "user's run” (runs.replay_agentrun); ask someone who has it.",
            run_id=str(run_id),
        )


class CancelNotPermitted(Refusal):
    status = 403
    code = "cancel_not_permitted"

    def __init__(self, run_id: Any):
        super().__init__(
            f"Run {run_id} was started by someone else: cancelling it needs the permission “Can cancel another "
            "user's run” (runs.cancel_agentrun); ask someone who has it.",
            run_id=str(run_id),
        )


class RetryNotPermitted(ReplayNotPermitted):
    """Processing an event again is replaying a run nobody in particular started: the replay permission."""

    def __init__(self) -> None:
        Refusal.__init__(
            self,
            "Processing a webhook event again needs the permission “Can replay another user's run” "
            "(runs.replay_agentrun); ask someone who has it.",
        )


class ResolveNotPermitted(Refusal):
    status = 403
    code = "resolve_not_permitted"

    def __init__(self) -> None:
        super().__init__(
            "Marking an event resolved closes it for good and needs the permission “Can mark a webhook event "
            "resolved” (runs.resolve_webhookevent); ask someone who has it."
        )


# --- Resume refusals (checked in the order of docs/architecture.md, "Resume rules") ----------------


class ResumeRefused(Refusal):
    """A refusal of `runs.rules.resume.decide_resume`: each says what to do instead (settle, replay, wait)."""


class ResumeRunWaiting(ResumeRefused):
    """A waiting run goes on by itself once its calls are answered: there is nothing to resume."""

    status = 409
    code = "run_waiting"


class ResumeRunInFlight(ResumeRefused):
    status = 409
    code = "run_in_flight"


class AlreadyContinued(ResumeRefused):
    """The run already has its one successor (a resume or a replay)."""

    status = 409
    code = "already_resumed"


class ContinuedByReplay(AlreadyContinued):
    code = "already_replayed"


class ResumeRunSucceeded(ResumeRefused):
    status = 409
    code = "run_succeeded"


class WorkflowNotResumable(ResumeRefused):
    status = 409
    code = "workflow_not_resumable"


class SessionGone(ResumeRefused):
    status = 410
    code = "session_gone"


class AgentChanged(ResumeRefused):
    status = 409
    code = "agent_changed"


class ResumeCallsInDoubt(ResumeRefused):
    status = 409
    code = "calls_in_doubt"


class ResumeNotPermitted(Refusal):
    status = 403
    code = "resume_not_permitted"

    def __init__(self) -> None:
        super().__init__(
            "Resuming someone else's run needs the permission “Can replay another user's run” (runs.replay_agentrun); "
            "ask its creator or someone who has it."
        )


class ConversationMovedOn(ResumeRefused):
    """A later turn already runs (or ran) in the session: the dangling calls are no longer the last thing said."""

    status = 409
    code = "conversation_moved_on"


# --- The orders the rules check in -------------------------------------------------------------------
# The first refusal that applies answers. `runs.rules.replay.decide` and `runs.rules.resume.decide_resume` check
# in these orders; the manual's tables (docs/runs.md), the API's descriptions and docs/architecture.md say them
# (the API's are written from these tuples), and tests/config/test_docs_truth.py holds all of them to it.

REPLAY_REFUSAL_ORDER: tuple[type[ReplayRefused], ...] = (
    RunWaiting,
    RunInFlight,
    ReplayInFlight,
    ResumeInFlight,
    InputGone,
    RunSucceeded,
    AlreadyReplayed,
    AlreadyResumed,
    CallsInDoubt,
    ToolsCalled,
    ToolsUnknown,
)

RESUME_REFUSAL_ORDER: tuple[type[ResumeRefused], ...] = (
    ResumeRunWaiting,
    ResumeRunInFlight,
    AlreadyContinued,
    ContinuedByReplay,
    ResumeRunSucceeded,
    ConversationMovedOn,
    WorkflowNotResumable,
    SessionGone,
    AgentChanged,
    ResumeCallsInDoubt,
)


# How the inbox reads a replay refusal of an event's last run: it, or what continues it (a replay or
# a resume), is still working (look later); or its work was finished or taken over (done here).
STILL_GOING: tuple[type[ReplayRefused], ...] = (RunWaiting, RunInFlight, ReplayInFlight, ResumeInFlight)
ALREADY_CONTINUED: tuple[type[ReplayRefused], ...] = (RunSucceeded, AlreadyReplayed, AlreadyResumed)


def said_in_order(refusals: tuple[type[Refusal], ...]) -> str:
    """An order as the API's descriptions say it: 409 `run_in_flight`, 409 `replay_in_flight`, …"""
    return ", ".join(f"{refusal.status} `{refusal.code}`" for refusal in refusals)


# --- Scripted tool faults ------------------------------------------------------------------------


class FaultsNotPermitted(Refusal):
    status = 403
    code = "faults_not_permitted"

    def __init__(self, placed: list[str]) -> None:
        super().__init__(
            f"The script places tool faults ({', '.join(placed)}); placing them needs the permission "
            "“Can place scripted tool faults” (runs.place_tool_faults), since a crash kills the worker "
            "and every run in flight on it."
        )


# --- Calls that wait (docs/architecture.md, "Approvals and tools that wait") -----------------------


class NotWaitingFor(Refusal):
    """The run waits for no such call (never asked, or the call id is another run's)."""

    status = 404
    code = "not_found"

    def __init__(self, run_id: Any, call_id: Any):
        super().__init__(
            f"Run {run_id} is not waiting for a decision or a result on call {call_id}.",
            run_id=str(run_id), call_id=str(call_id),
        )


class AlreadyDecided(Refusal):
    """A call's decision is used once: the first one stands."""

    status = 409
    code = "already_decided"

    def __init__(self, call_id: str, decision: str, decided_by: str, decided_at: str):
        super().__init__(
            f"Call {call_id} was already answered ({decision}, by {decided_by} at {decided_at}); a decision is "
            "taken once and the run went on with it.",
            call_id=call_id, decision=decision, decided_by=decided_by, decided_at=decided_at,
        )


class WrongAnswerKind(Refusal):
    """A decision sent for a long-running call, or a result for a confirmation."""

    status = 409
    code = "wrong_answer_kind"

    def __init__(self, call_id: str, waits_for: str, door: str):
        super().__init__(
            f"Call {call_id} waits for {waits_for}; send it to …/calls/{call_id}/{door}/ instead.",
            call_id=call_id, waits_for=waits_for,
        )


class ApproveNotPermitted(Refusal):
    status = 403
    code = "approve_not_permitted"

    def __init__(self) -> None:
        super().__init__(
            "Approving or rejecting a tool call needs the permission “Can approve or reject a tool call that waits "
            "for a person” (runs.approve_toolcall); ask someone who has it."
        )


class AnswerNotPermitted(Refusal):
    status = 403
    code = "answer_not_permitted"

    def __init__(self) -> None:
        super().__init__(
            "Giving a long-running call's result needs the permission “Can give the result of a long-running tool "
            "call” (runs.answer_toolcall); ask someone who has it."
        )


class ApprovalByStarter(Refusal):
    status = 403
    code = "approval_by_starter"

    def __init__(self, run_id: Any):
        super().__init__(
            f"You started run {run_id}, so you may not approve or reject its calls: a confirmation stands for a "
            "second person (APPROVAL_BY_STARTER_ALLOWED is false). Ask another approver.",
            run_id=str(run_id),
        )


class UnknownDecision(Refusal):
    status = 400
    code = "unknown_decision"

    def __init__(self, value: Any):
        super().__init__(f"decision must be approve or reject, not {value!r}.", decision=str(value)[:64])


class PayloadNotAllowed(Refusal):
    status = 400
    code = "payload_invalid"

    def __init__(self, why: str):
        super().__init__(why)
