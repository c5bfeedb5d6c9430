"""Each tool call's honest state, in one place: the run list, the run page, the API, the desk and
the metrics all say what this module says.

A call is one of: waiting (for a person's approval, or for its long-running result), rejected
(never ran), timed out (never ran), closed (its run was cancelled while it waited; never ran),
answered (a long-running call given its result), ran (the tool answered), failed (the tool
raised), served from a record or refused by its key (the tool did not run again), running, in
doubt (started, never finished, nobody has said whether it acted), or, for a tool that only reads,
unanswered (it never answered, and calling it again changes nothing: nothing is in doubt).
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.effects import READ_ONLY
from runs.models.approvals import Decision, PendingCall, WaitKind
from runs.models.ledger import UNSETTLED, ToolCallStatus

WAITING = "waiting"
WAITING_RESULT = "waiting_result"
REJECTED = "rejected"
TIMED_OUT = "timed_out"
CLOSED = "closed"
ANSWERED = "answered"
RAN = "ran"
FAILED = "failed"
DEDUPLICATED = "deduplicated"
REFUSED = "refused"
RUNNING = "running"
IN_DOUBT = "in_doubt"
SETTLED_DONE = "settled_done"
SETTLED_NOT_DONE = "settled_not_done"
UNANSWERED_READ = "unanswered_read"

LABELS = {
    WAITING: "waiting for approval",
    WAITING_RESULT: "waiting for its result",
    REJECTED: "rejected, not run",
    TIMED_OUT: "timed out, not run",
    CLOSED: "closed unanswered, not run",
    ANSWERED: "answered with a result",
    RAN: "ran",
    FAILED: "failed",
    DEDUPLICATED: "served from its record, not run again",
    REFUSED: "refused by its key, not run",
    RUNNING: "running",
    IN_DOUBT: "in doubt",
    SETTLED_DONE: "in doubt, settled: it acted",
    SETTLED_NOT_DONE: "in doubt, settled: it did not act",
    UNANSWERED_READ: "never answered; it only reads, so nothing is in doubt",
}
# The badge colour of each state: what needs a person, what went wrong, what is fine.
TONES = {
    WAITING: "attention", WAITING_RESULT: "attention", IN_DOUBT: "attention",
    REJECTED: "quiet", TIMED_OUT: "quiet", CLOSED: "quiet", DEDUPLICATED: "quiet", REFUSED: "bad",
    FAILED: "bad", RUNNING: "busy", ANSWERED: "good", RAN: "good", SETTLED_DONE: "good", SETTLED_NOT_DONE: "quiet",
    UNANSWERED_READ: "quiet",
}
# States in which the tool did not run (the call is never in `tools_executed`).
NOT_RUN = frozenset({WAITING, REJECTED, TIMED_OUT, CLOSED})


@dataclass(frozen=True)
class CallState:
    code: str

    @property
    def label(self) -> str:
        return LABELS[self.code]

    @property
    def tone(self) -> str:
        return TONES[self.code]

    @property
    def ran(self) -> bool:
        return self.code not in NOT_RUN


def call_state(
    *,
    status: str,
    in_doubt: bool,
    run_in_flight: bool,
    settled_outcome: str = "",
    wait_kind: str = "",
    decision: str = "",
    by_system: bool = False,
    read_only: bool = False,
) -> CallState:
    """The state of one journal row, given its wait (a PendingCall's kind and decision), if any."""
    if wait_kind == WaitKind.CONFIRMATION and decision != Decision.APPROVE:
        if decision == Decision.REJECT:
            return CallState(TIMED_OUT if by_system else REJECTED)
        if decision == Decision.CANCELLED:
            return CallState(CLOSED)
        return CallState(WAITING if run_in_flight else CLOSED)
    if status in (ToolCallStatus.WAITING, ToolCallStatus.NOT_RUN):
        # A journal row whose wait record is gone (retention): what the row says.
        return CallState(WAITING if status == ToolCallStatus.WAITING and run_in_flight else CLOSED)
    if wait_kind == WaitKind.RESULT:
        if not decision:
            return CallState(WAITING_RESULT if run_in_flight else CLOSED)
        if decision == Decision.RESULT:
            return CallState(TIMED_OUT if by_system else ANSWERED)
    if settled_outcome:
        return CallState(SETTLED_DONE if settled_outcome == "done" else SETTLED_NOT_DONE)
    if in_doubt:
        return CallState(IN_DOUBT)
    if status == ToolCallStatus.CALLED:
        if run_in_flight:
            return CallState(RUNNING)
        return CallState(UNANSWERED_READ if read_only else IN_DOUBT)
    return CallState({
        ToolCallStatus.FAILED: FAILED,
        ToolCallStatus.DEDUPLICATED: DEDUPLICATED,
        ToolCallStatus.REFUSED: REFUSED,
    }.get(status, RAN))


def states_of(run, calls) -> dict[str, CallState]:
    """Every call's state, by call id, with one query for the run's waits."""
    waits = {
        call_id: (kind, decision, by_system)
        for call_id, kind, decision, by_system in PendingCall.objects.filter(run_id=run.run_id).values_list(
            "call_id", "kind", "decision", "by_system"
        )
    }
    states = {}
    for call in calls:
        kind, decision, by_system = waits.get(call.call_id, ("", "", False))
        states[call.call_id] = call_state(
            status=call.status, in_doubt=call.in_doubt, run_in_flight=run.status in UNSETTLED,
            settled_outcome=call.settled_outcome, wait_kind=kind, decision=decision, by_system=by_system,
            read_only=call.effect == READ_ONLY,
        )
    return states
