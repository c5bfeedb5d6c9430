"""May this run be replayed now? One answer for every door (API, admin, commands).

`decide_on_facts()` is pure: given a run and the facts about it (its replays and resumes,
whether its stored input is still there, its journal), it returns the decision without reading
or touching anything. `gather_facts()` reads those facts (two queries); `decide()` is the two
together, reading the facts when it is not handed them.

The rows of the table are checked in the fixed order of `runs.refusals.REPLAY_REFUSAL_ORDER` and
the first that applies answers: the final ones first (nobody can fix them by forcing), then —
without force — the forceable ones, with "every call read only" (replayed) just before
tools_called.

The journal's calls are facts too: each call's effect class as it was at call time, its status,
a person's settlement and the state of its effect record. A call may act again on a replay unless
it is read only, was answered from an effect record (deduplicated) or refused by one, or a person
settled that it did not act; a tool the run called with no journal row is assumed to act.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from django.db.models import OuterRef, Subquery

from config.lib.refusals import Refusal
from runs.ledger import chain
from runs.ledger.chain import Successor
from runs.models.effects import EffectStatus, ToolEffect
from runs.models.ledger import IN_FLIGHT, UNSETTLED, AgentRun, RunStatus, SettledOutcome, ToolCall, ToolCallStatus
from runs.refusals import (
    AlreadyReplayed,
    AlreadyResumed,
    CallsInDoubt,
    InputGone,
    ReplayInFlight,
    ReplayRefused,
    ResumeInFlight,
    RunInFlight,
    RunSucceeded,
    RunWaiting,
    ToolsCalled,
    ToolsUnknown,
)

READ_ONLY = "read_only"


@dataclass(frozen=True)
class CallFact:
    """One journal row, with what its effect record says (the record under the key it used)."""

    seq: int
    call_id: str
    tool_name: str
    effect: str = ""  # "" = not known: treated as effectful
    status: str = ToolCallStatus.ANSWERED
    settled_outcome: str = ""
    effect_key: str = ""
    effect_status: str = ""  # the record's status ("" = no record)
    owns_record: bool = False  # this call started the record (rather than being served by it)

    @property
    def in_doubt(self) -> bool:
        """Started and never finished, and no person has said what happened (the run is over). A
        tool that only reads leaves nothing in doubt: calling it again changes nothing."""
        if self.settled_outcome or self.effect == READ_ONLY:
            return False
        return self.status == ToolCallStatus.CALLED or (self.owns_record and self.effect_status == EffectStatus.STARTED)

    @property
    def may_act_again(self) -> bool:
        if self.effect == READ_ONLY or self.status in (ToolCallStatus.DEDUPLICATED, ToolCallStatus.REFUSED):
            return False
        return self.settled_outcome != SettledOutcome.NOT_DONE


@dataclass(frozen=True)
class ReplayFacts:
    """What decide() needs beyond the row itself."""

    replays: tuple[Successor, ...] = ()
    input_present: bool = True
    calls: tuple[CallFact, ...] = ()
    # Its resumes (runs.rules.resume): they continue the same work in its session.
    resumes: tuple[Successor, ...] = ()


class RuleDecision:
    """What a decision of either rule (replay, resume) says the same way: allowed or not, the HTTP
    status its request would get, and its code (`allowed_code`, or the refusal's)."""

    refusal: Refusal | None
    allowed_code: ClassVar[str]

    @property
    def allowed(self) -> bool:
        return self.refusal is None

    @property
    def status(self) -> int:
        return 202 if self.refusal is None else self.refusal.status

    @property
    def code(self) -> str:
        return self.allowed_code if self.refusal is None else self.refusal.code


@dataclass(frozen=True)
class Decision(RuleDecision):
    """The answer for one run: allowed, or the refusal that applies.

    `overridden` is the refusal that force set aside (None when no force was needed), so a door
    can say what it is overriding.
    """

    force: bool
    refusal: ReplayRefused | None = None
    overridden: ReplayRefused | None = field(default=None)
    allowed_code: ClassVar[str] = "replayable"

    def as_dict(self) -> dict:
        """The decision as the API shows it: `status` is the HTTP status a replay request would get."""
        if self.refusal is None:
            return {"allowed": True, "status": 202, "code": self.code, "detail": "A replay would start now."}
        body = self.refusal.as_dict()
        # A refusal's context may name the run's own status; it must not take the place of the HTTP status.
        if "status" in body:
            body["run_status"] = body.pop("status")
        return {**body, "allowed": False, "status": self.refusal.status}


def tool_names_once(tools: list[str] | None) -> list[str]:
    """Each tool once, in the order it was first called."""
    return list(dict.fromkeys(tools or []))


def decide(run: AgentRun, *, force: bool, facts: ReplayFacts | None = None) -> Decision:
    """The replay rules for `run` now: `decide_on_facts` on `facts`, read first (`gather_facts`) when not given."""
    return decide_on_facts(run, force=force, facts=facts if facts is not None else gather_facts(run))


def decide_on_facts(run: AgentRun, *, force: bool, facts: ReplayFacts) -> Decision:
    """The replay rules, pure: the row and `facts`, checked in the order of
    `runs.refusals.REPLAY_REFUSAL_ORDER`; the first refusal that applies answers (force sets
    aside only the forceable ones)."""

    final = _final_refusal(run, facts)
    if final is not None:
        return Decision(force, final)
    refusal = _refusal_without_force(run, facts)
    if refusal is None:
        return Decision(force)
    if force and refusal.forceable:
        return Decision(force, overridden=refusal)
    return Decision(force, refusal)


def _final_refusal(run: AgentRun, facts: ReplayFacts) -> ReplayRefused | None:
    """The refusals nobody can set aside by forcing: something still runs or waits, or the input is gone."""
    if run.status == RunStatus.WAITING:
        return RunWaiting(
            "This run is waiting for a decision on a tool call (or a long-running call's result): it goes on "
            "by itself once answered. Approve or reject the call, or cancel the run, instead of replaying it.",
            status=run.status,
        )
    if run.status in IN_FLIGHT:
        return RunInFlight(
            f"This run is still {run.status}: a replay now could do its work twice. "
            "Cancel it or wait for it to finish.",
            status=run.status,
        )
    in_flight = next((r for r in facts.replays if r.status in UNSETTLED), None)
    if in_flight is not None:
        return ReplayInFlight(
            f"This run's replay {in_flight.run_id} is still {in_flight.status}: wait for it to "
            "finish (or cancel it) before replaying the run again.",
            replay_run_id=str(in_flight.run_id),
            replay_status=in_flight.status,
        )
    resuming = next((r for r in facts.resumes if r.status in UNSETTLED), None)
    if resuming is not None:
        return ResumeInFlight(
            f"This run's resume {resuming.run_id} is still {resuming.status}: it continues the same work, so "
            "wait for it to finish (or cancel it) before replaying the run.",
            resume_run_id=str(resuming.run_id),
            resume_status=resuming.status,
        )
    if run.input_file and not facts.input_present:
        return InputGone(
            f"The stored copy of this run's input file “{run.input_file_name}” is gone from disk "
            "(or no longer matches what the run was given), so the run cannot be repeated with "
            "the same input, even by force. Start a new run with the file instead.",
            input_file_name=run.input_file_name,
        )
    return None


def _refusal_without_force(run: AgentRun, facts: ReplayFacts) -> ReplayRefused | None:
    if run.status == RunStatus.SUCCESS:
        return RunSucceeded("This run succeeded: a replay would do all of its work again.")
    succeeded = next((r for r in facts.replays if r.status == RunStatus.SUCCESS), None)
    if succeeded is not None:
        return AlreadyReplayed(f"This run was already replayed successfully by run {succeeded.run_id}.",
            replay_run_id=str(succeeded.run_id),
        )
    resumed = next((r for r in facts.resumes if r.status == RunStatus.SUCCESS), None)
    if resumed is not None:
        return AlreadyResumed(f"This run was already finished by its resume, run {resumed.run_id}.",
            resume_run_id=str(resumed.run_id),
        )
    tools = tool_names_once(run.tools_executed)
    if tools:
        in_doubt = [call for call in facts.calls if call.in_doubt and call.effect != READ_ONLY]
        if in_doubt:
            return calls_in_doubt_refusal(in_doubt)
        acting = tools_that_may_act(tools, facts.calls)
        if not acting:
            return None  # every call read only (or known not to act again): harmless to repeat
        return ToolsCalled(f"This run already called {', '.join(acting)} before failing: a replay would call "
            f"{'them' if len(acting) > 1 else 'it'} again.",
            tools=acting,
        )
    if run.tools_executed is None:
        return ToolsUnknown("It is unknown whether this run called any tool before failing, so a replay "
            "could repeat a side effect.",
        )
    return None


def tools_that_may_act(tools: list[str], calls: tuple[CallFact, ...]) -> list[str]:
    """The called tools (once, in first-call order) a replay could make act again."""
    journaled = {call.tool_name for call in calls}
    acting = {call.tool_name for call in calls if call.may_act_again}
    return [name for name in tools if name in acting or name not in journaled]


def calls_in_doubt_refusal(calls: list[CallFact]) -> CallsInDoubt:
    names = tool_names_once([call.tool_name for call in calls])
    if len(calls) == 1:
        sentence = (
            f"This run's call to {names[0]} is in doubt: it was started and never finished, so it is unknown "
            "whether it acted, and a replay could do it again. Settle it (done or not done) once you know."
        )
    else:
        sentence = (
            f"This run's calls to {', '.join(names)} are in doubt: each was started and never finished, so it is "
            "unknown whether they acted, and a replay could do it again. Settle each (done or not done) once you know."
        )
    return CallsInDoubt(sentence, tools=names, calls=[call.call_id for call in calls])


# --- What a replay would do with each recorded call ------------------------------------------------

SERVED = "served from record"
RUNS_AGAIN = "runs again"
REFUSED = "refused"
NEEDS_A_PERSON = "needs a person"


def preview_call(call: CallFact) -> tuple[str, str]:
    """(with effects reused, with effects redone) for one recorded call, given the same arguments."""
    if call.effect == READ_ONLY:
        return RUNS_AGAIN, RUNS_AGAIN
    # Redone effects get new keys: every call that acts runs again.
    if call.status == ToolCallStatus.REFUSED and call.effect_status:
        return REFUSED, RUNS_AGAIN
    if call.effect_status == EffectStatus.DONE:
        return SERVED, RUNS_AGAIN
    if call.effect_status == EffectStatus.STARTED:
        return NEEDS_A_PERSON, RUNS_AGAIN
    return RUNS_AGAIN, RUNS_AGAIN


def preview(facts: ReplayFacts) -> list[dict]:
    rows = []
    for call in facts.calls:
        reuse, redo = preview_call(call)
        rows.append({"seq": call.seq, "call_id": call.call_id, "tool_name": call.tool_name,
                     "effect": call.effect or "effectful", "reuse": reuse, "redo": redo})
    return rows


# --- Facts ---------------------------------------------------------------------------------------


def input_file_present(run: AgentRun, *, verify_digest: bool = False) -> bool:
    """Is the stored copy still there, the same size (and, if asked, the same bytes)?"""
    if not run.input_file:
        return True
    path = Path(run.input_file)
    try:
        if not path.is_file():
            return False
        if run.input_file_size is not None and path.stat().st_size != run.input_file_size:
            return False
        if verify_digest and run.input_file_sha256:
            digest = hashlib.sha256()
            with path.open("rb") as handle:
                while chunk := handle.read(1024 * 1024):
                    digest.update(chunk)
            return digest.hexdigest() == run.input_file_sha256
    except OSError:
        return False
    return True


def gather_facts(run: AgentRun, *, verify_digest: bool = False) -> ReplayFacts:
    # The whole chain below the run: a continuation's own continuation that succeeded (or is in
    # flight) decides the run's fate as much as a direct one.
    successors = chain.descendants(run)
    return ReplayFacts(
        resumes=tuple(successor for successor in successors if successor.kind == chain.RESUME),
        replays=tuple(successor for successor in successors if successor.kind == chain.REPLAY),
        input_present=input_file_present(run, verify_digest=verify_digest),
        calls=journal_facts(run),
    )


def _same_run(value: object, run_id: uuid.UUID) -> bool:
    # A subquery's UUID comes back as the backend stores it (32 hex digits on SQLite).
    try:
        return value is not None and uuid.UUID(str(value)) == run_id
    except ValueError:
        return False


def journal_facts(run: AgentRun) -> tuple[CallFact, ...]:
    """The run's journal with each call's effect record, in one query."""
    record = ToolEffect.objects.filter(key=OuterRef("effect_key"))
    rows = (
        ToolCall.objects.filter(run_id=run.run_id)
        .order_by("seq")
        .annotate(
            record_status=Subquery(record.values("status")[:1]),
            record_run=Subquery(record.values("first_run_id")[:1]),
            record_call=Subquery(record.values("first_call_id")[:1]),
        )
        .values_list("seq", "call_id", "tool_name", "effect", "status", "settled_outcome", "effect_key",
                     "record_status", "record_run", "record_call")
    )
    return tuple(
        CallFact(
            seq=seq, call_id=call_id, tool_name=tool_name, effect=effect, status=status,
            settled_outcome=settled, effect_key=key, effect_status=record_status or "",
            owns_record=record_status is not None and _same_run(record_run, run.run_id) and record_call == call_id,
        )
        for seq, call_id, tool_name, effect, status, settled, key, record_status, record_run, record_call in rows
    )


def describe_now(run: AgentRun, *, facts: ReplayFacts | None = None) -> dict:
    """What a replay would do now, without and with force (for the run page and the API)."""
    facts = facts if facts is not None else gather_facts(run)
    plain = decide(run, force=False, facts=facts)
    forced = decide(run, force=True, facts=facts)
    return {**plain.as_dict(), "force_would_replay": forced.allowed, "preview": preview(facts)}
