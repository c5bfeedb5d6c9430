"""May this run be resumed now, and with what? One answer for every door (API, admin).

A resume continues a failed run **in its own session** instead of starting again
(docs/architecture.md, "Resume rules"): a new run (`resume_of` = the original, same session, a
new invocation) answers each dangling function call — a call in the session with no response —
from evidence, then lets the model go on. No tool that already ran runs again.

`decide_resume_on_facts()` is pure, shaped like `runs.rules.replay.decide_on_facts`: given the run and
the facts about it (`gather_resume_facts`: its successors, its journal with each call's effect
record and settlement, what its session still holds, the agent's fingerprint now) it returns the
refusal that applies, or the answer each dangling call would get, checked in the order of
`runs.refusals.RESUME_REFUSAL_ORDER` (the first that applies answers). `decide_resume()` reads
the facts when it is not handed them, and only as far as needed: the row and its successors
(`refusal_before_the_session`) decide most runs shown without reading their session.

A chat turn is resumed inside its conversation: the same session, so the resume becomes the turn
the conversation's next message follows.

Each dangling call is answered by the first of:
- a person's settlement: `done` → "it was done", with their note as evidence (and the tool's
  recorded result if it has one); `not_done` → "it did not happen";
- its effect record: `done` → the recorded result, as the tool said it; `failed` → "it did not
  happen";
- the journal: a call its effect record refused, or one not run because its key was in doubt
  elsewhere → "it did not happen"; a tool that raised → "it failed", with its error;
- a read-only call that never answered → "it did not happen" (calling it again only reads);
- otherwise the call is in doubt (called, never answered, not read only, no done/failed record,
  no settlement: unknown is not none) and the resume is refused until a person settles it.

A workflow run is refused (`workflow_not_resumable`): ADK rebuilds a workflow's completed steps
only from the events of the invocation it runs under, and a resume has an invocation of its own;
replay it instead.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from google.genai import types

from agents.models import AdkEvent
from agents.registry import UnknownAgentError, fingerprint, get_agent_spec, workflow_fingerprint_of
from agents.scripted import SCRIPT_STEP_KEY, ScriptPosition, resume_position
from runs.ledger import approvals, chain
from runs.ledger.chain import Successor
from runs.models.approvals import Decision, PendingCall
from runs.models.effects import EffectStatus, ToolEffect
from runs.models.ledger import (
    IN_FLIGHT,
    NEVER_RAN,
    UNSETTLED,
    AgentRun,
    RunStatus,
    SettledOutcome,
    ToolCall,
    ToolCallStatus,
)
from runs.refusals import (
    AgentChanged,
    AlreadyContinued,
    ContinuedByReplay,
    ConversationMovedOn,
    ResumeCallsInDoubt,
    ResumeRefused,
    ResumeRunInFlight,
    ResumeRunSucceeded,
    ResumeRunWaiting,
    SessionGone,
    WorkflowNotResumable,
)
from runs.rules.replay import READ_ONLY, CallFact, RuleDecision, journal_facts, tool_names_once

logger = logging.getLogger(__name__)


# How a dangling call is answered (the preview's words).
FROM_RECORD = "answered from the record"
SETTLED_DONE = "answered from a settlement: done"
SETTLED_NOT_DONE = "answered from a settlement: not done"
NOT_DONE = "answered: it did not happen"
FAILED = "answered: it failed"
IN_DOUBT = "in doubt: a person must settle it"
FROM_DECISION = "answered from its recorded decision"


# --- Facts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallEvidence:
    """One journal row with what a resume reads beyond the replay rules' facts."""

    fact: CallFact
    settle_note: str = ""
    response_summary: str = ""
    record_result: Any = None


@dataclass(frozen=True)
class ResumeFacts:
    successors: tuple[Successor, ...] = ()
    calls: tuple[CallEvidence, ...] = ()
    # (call id, tool name) of each call of the run's invocation with no response in the session.
    dangling: tuple[tuple[str, str], ...] = ()
    session_present: bool = True
    fingerprint_now: str = ""
    # A run written later in the same session (a chat's next turn), other than this run's resumes.
    later_run: tuple[uuid.UUID, str] | None = None
    # The answers a person (or the system, or an external system) gave the calls the run waited for,
    # by the id of the call they answer: a confirmation request's, or a long-running call's.
    decided: tuple[Answer, ...] = ()


@dataclass(frozen=True)
class Answer:
    call_id: str
    tool_name: str
    kind: str
    response: dict | None = None  # what the model sees (None while in doubt)
    effect: str = ""

    @property
    def not_done(self) -> bool:
        return self.kind in (SETTLED_NOT_DONE, NOT_DONE)

    def as_preview(self) -> dict:
        return {"call_id": self.call_id, "tool_name": self.tool_name, "effect": self.effect or "effectful",
                "answer": self.kind, "model_sees": self.response}


@dataclass(frozen=True)
class ResumeDecision(RuleDecision):
    refusal: ResumeRefused | None = None
    answers: tuple[Answer, ...] = ()
    allowed_code: ClassVar[str] = "resumable"

    def as_dict(self) -> dict:
        """The decision as the API shows it: `status` is the HTTP status a resume request would get."""
        preview = [answer.as_preview() for answer in self.answers]
        if self.refusal is None:
            return {"allowed": True, "status": 202, "code": self.code,
                    "detail": "A resume would continue this run in its session now.", "preview": preview}
        body = self.refusal.as_dict()
        if "status" in body:
            body["run_status"] = body.pop("status")
        return {**body, "allowed": False, "status": self.refusal.status, "preview": preview}


def current_fingerprint(*, agent_name: str, workflow: dict | None) -> str:
    """The definition a run of `agent_name` (or of a workflow snapshot) would execute now; "" if it cannot load."""
    try:
        if workflow:
            return workflow_fingerprint_of(workflow)
        return fingerprint(get_agent_spec(agent_name))
    except (UnknownAgentError, ValueError, KeyError, TypeError):
        return ""


def chain_of(run: AgentRun) -> list[AgentRun]:
    """The run and the runs it resumes, newest first (they share the session)."""
    return [run, *chain.predecessors(run, via=chain.RESUMES)]


def _session_events(run: AgentRun) -> list[tuple[str, dict]]:
    rows = AdkEvent.objects.of_session(
        app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id
    ).values_list("invocation_id", "event_data")
    return [(invocation_id, data or {}) for invocation_id, data in rows]


def _parts(data: dict) -> list[dict]:
    return (data.get("content") or {}).get("parts") or []


def _is_user_message(data: dict) -> bool:
    return data.get("author") == "user" and any(part.get("text") or part.get("inline_data") for part in _parts(data))


def _calls_of(data: dict) -> list[dict]:
    return [part["function_call"] for part in _parts(data) if part.get("function_call")]


def gather_resume_facts(run: AgentRun, *, successors: tuple[Successor, ...] | None = None) -> ResumeFacts:
    if successors is None:
        successors = chain.successors(run)
    facts = journal_facts(run)
    extra = {
        call_id: (note, summary, key)
        for call_id, note, summary, key in ToolCall.objects.filter(run_id=run.run_id).values_list(
            "call_id", "settle_note", "response_summary", "effect_key"
        )
    }
    keys = {key for _note, _summary, key in extra.values() if key}
    results = dict(ToolEffect.objects.filter(key__in=keys).values_list("key", "result")) if keys else {}
    calls = tuple(
        CallEvidence(
            fact=fact,
            settle_note=extra.get(fact.call_id, ("", "", ""))[0],
            response_summary=extra.get(fact.call_id, ("", "", ""))[1],
            record_result=results.get(fact.effect_key),
        )
        for fact in facts
    )

    events = _session_events(run)
    answered = {
        part["function_response"].get("id")
        for _invocation, data in events
        for part in _parts(data)
        if part.get("function_response")
    }
    own_calls = [call for invocation, data in events if invocation == run.invocation_id for call in _calls_of(data)]
    # A call that waited for its approval was answered once already ("requires confirmation"); once
    # approved, its journal row says `called` again until its tool answers. The journal decides.
    rearmed = {fact.call_id for fact in facts if fact.status == ToolCallStatus.CALLED}
    dangling = tuple(
        (call.get("id") or "", call.get("name") or "") for call in own_calls
        if call.get("id") not in answered or call.get("id") in rearmed
    )
    # The purge deletes the oldest events first: the chain's first user message is its oldest.
    root = chain_of(run)[-1]
    session_present = any(invocation == root.invocation_id and _is_user_message(data) for invocation, data in events)
    if facts and not any(invocation == run.invocation_id for invocation, _data in events):
        session_present = False
    later = (
        AgentRun.objects.filter(session_id=run.session_id, created_at__gt=run.created_at)
        .exclude(resume_of_id=run.run_id)
        .exclude(replay_of_id=run.run_id)
        .order_by("created_at")
        .values_list("run_id", "status")
        .first()
    )
    return ResumeFacts(
        decided=decided_answers(run),
        later_run=later,
        successors=successors,
        calls=calls,
        dangling=dangling,
        session_present=session_present,
        fingerprint_now=current_fingerprint(agent_name=run.agent_name, workflow=run.workflow),
    )


# --- Answers ---------------------------------------------------------------------------------------


def _settlement_stub(result: Any) -> bool:
    return isinstance(result, dict) and result.get("settled_by_person") is True


def _not_done(call_id: str, tool: str, kind: str, why: str, effect: str) -> Answer:
    return Answer(call_id, tool, kind, {
        "status": "not_done",
        "error": f"This call did not happen: {why} Call it again if it is still needed.",
    }, effect)


def answer_for(call_id: str, tool_name: str, evidence: CallEvidence | None) -> Answer:
    """What the model is told about one dangling call (or that a person must settle it first)."""
    if evidence is None:
        # A call the journal never saw: nothing says what it did.
        return Answer(call_id, tool_name, IN_DOUBT)
    fact = evidence.fact
    effect = fact.effect
    if fact.settled_outcome == SettledOutcome.DONE:
        response: dict = {
            "status": "done",
            "detail": "The tool did not answer before the run stopped; a person settled that it was done.",
            "evidence": evidence.settle_note,
        }
        if evidence.record_result is not None and not _settlement_stub(evidence.record_result):
            response["result"] = evidence.record_result
        return Answer(call_id, tool_name, SETTLED_DONE, response, effect)
    if fact.settled_outcome == SettledOutcome.NOT_DONE:
        return _not_done(call_id, tool_name, SETTLED_NOT_DONE,
                         f"a person settled that it did not act ({evidence.settle_note}).", effect)
    if fact.status in NEVER_RAN:
        return _not_done(call_id, tool_name, NOT_DONE, "it was asked of a person and never ran.", effect)
    if fact.status == ToolCallStatus.REFUSED:
        return _not_done(call_id, tool_name, NOT_DONE, "its idempotency key was already used with other arguments.",
                         effect)
    if fact.effect_status == EffectStatus.DONE:
        result = evidence.record_result
        return Answer(call_id, tool_name, FROM_RECORD, result if isinstance(result, dict) else {"result": result}, effect)
    if fact.effect_status == EffectStatus.FAILED:
        return _not_done(call_id, tool_name, NOT_DONE, "its effect record says it did not act.", effect)
    if fact.in_doubt and effect != READ_ONLY:
        return Answer(call_id, tool_name, IN_DOUBT, None, effect)
    if fact.status == ToolCallStatus.FAILED:
        summary = evidence.response_summary
        if summary.startswith("not run:"):
            return _not_done(call_id, tool_name, NOT_DONE, "it was not run (its effect was in doubt elsewhere).",
                             effect)
        return Answer(call_id, tool_name, FAILED, {
            "status": "failed", "error": f"The tool failed before it answered: {summary or 'no error was recorded'}",
        }, effect)
    return _not_done(call_id, tool_name, NOT_DONE, "it did not answer before the run stopped (it only reads).",
                     effect)


def decided_answers(run: AgentRun) -> tuple[Answer, ...]:
    """The answers recorded for the calls `run` waited for (`runs.ledger.approvals`), as a resume hands them to ADK.

    A worker that died after the decision but before the answers reached the session leaves the
    confirmation request (or the long-running call) without a response: the decision is its evidence.
    """
    answers = []
    for pending in PendingCall.objects.filter(run_id=run.run_id).exclude(decision="").exclude(
            decision=Decision.CANCELLED):
        response = approvals.response_for(pending)
        answers.append(Answer(response.id or "", response.name or "", FROM_DECISION, response.response, ""))
    return tuple(answers)


def answers_for(facts: ResumeFacts) -> tuple[Answer, ...]:
    by_id = {evidence.fact.call_id: evidence for evidence in facts.calls}
    decided = {answer.call_id: answer for answer in facts.decided}
    return tuple(
        decided.get(call_id) or answer_for(call_id, tool, by_id.get(call_id)) for call_id, tool in facts.dangling
    )


# --- The rules -------------------------------------------------------------------------------------


def decide_resume(run: AgentRun, *, facts: ResumeFacts | None = None) -> ResumeDecision:
    """The resume rules for `run` now: `decide_resume_on_facts` on `facts` when given.

    Without them it reads them, only as far as needed: the row and its successors decide most runs
    shown (in flight, continued, succeeded) without reading their session's events
    (`gather_resume_facts` reads the rest).
    """
    if facts is None:
        successors = () if run.status in UNSETTLED else chain.successors(run)
        early = refusal_before_the_session(run, successors)
        if early is not None:
            return early
        facts = gather_resume_facts(run, successors=successors)
    return decide_resume_on_facts(run, facts=facts)


def refusal_before_the_session(run: AgentRun, successors: tuple[Successor, ...]) -> ResumeDecision | None:
    """The refusals the row and its successors decide (pure): waiting, in flight, continued once already, succeeded."""
    if run.status == RunStatus.WAITING:
        return ResumeDecision(ResumeRunWaiting(
            "This run is waiting for a decision on a tool call (or a long-running call's result): it goes on by "
            "itself, in its session, once answered. Approve or reject the call instead of resuming it.",
            status=run.status,
        ))
    if run.status in IN_FLIGHT:
        return ResumeDecision(ResumeRunInFlight(
            f"This run is still {run.status}: there is nothing to resume yet. Wait for it to finish, or cancel it.",
            status=run.status,
        ))
    if successors:
        successor = successors[0]
        if successor.kind == chain.RESUME:
            return ResumeDecision(AlreadyContinued(
                f"This run was already resumed by run {successor.run_id} ({successor.status}): a run is continued "
                "once. Resume or replay that run instead.",
                successor_run_id=str(successor.run_id), successor_status=successor.status,
            ))
        return ResumeDecision(ContinuedByReplay(
            f"This run was already replayed by run {successor.run_id} ({successor.status}): a run is continued "
            "once. Resume or replay that run instead.",
            successor_run_id=str(successor.run_id), successor_status=successor.status,
        ))
    if run.status == RunStatus.SUCCESS:
        return ResumeDecision(ResumeRunSucceeded("This run succeeded: there is nothing left to continue."))
    return None


def decide_resume_on_facts(run: AgentRun, *, facts: ResumeFacts) -> ResumeDecision:
    """The resume rules, pure: the row and `facts` (`gather_resume_facts`), checked in the order of
    `runs.refusals.RESUME_REFUSAL_ORDER`; the first refusal that applies answers."""
    early = refusal_before_the_session(run, facts.successors)
    if early is not None:
        return early
    if facts.later_run is not None:
        later_id, later_status = facts.later_run
        return ResumeDecision(ConversationMovedOn(
            f"The conversation went on after this turn (run {later_id}, {later_status}): its unanswered calls are no "
            "longer the last thing said, so it cannot be continued. Replay it instead.",
            later_run_id=str(later_id), later_status=later_status,
        ))
    if run.workflow:
        return ResumeDecision(WorkflowNotResumable(
            "This is a workflow run: a resume continues one agent's conversation, not a workflow's steps. "
            "Replay it instead."
        ))
    if not facts.session_present:
        return ResumeDecision(SessionGone(
            "This run's session events were purged (EVENTS_RETENTION_DAYS), so there is no conversation left to "
            "continue. Replay it instead: a replay starts again in a fresh session."
        ))
    if not run.agent_fingerprint or run.agent_fingerprint != facts.fingerprint_now:
        said = (
            "its definition was not recorded when it started" if not run.agent_fingerprint
            else "its instruction, tools or model changed since this run started"
        )
        return ResumeDecision(AgentChanged(
            f"The agent {run.agent_name!r} is not the one this run talked to ({said}): continuing its conversation "
            "would mix two agents. Replay it instead.",
            agent=run.agent_name,
        ))
    answers = answers_for(facts)
    in_doubt = [answer for answer in answers if answer.kind == IN_DOUBT]
    if in_doubt:
        names = tool_names_once([answer.tool_name for answer in in_doubt])
        return ResumeDecision(ResumeCallsInDoubt(
            f"This run's call{'s' if len(in_doubt) > 1 else ''} to {', '.join(names)} "
            f"{'are' if len(in_doubt) > 1 else 'is'} in doubt: started and never finished, so it is unknown "
            "whether it acted, and a resume must tell the model what happened. Settle "
            f"{'each' if len(in_doubt) > 1 else 'it'} (done or not done) once you know, then resume.",
            tools=names, calls=[answer.call_id for answer in in_doubt],
        ), answers)
    return ResumeDecision(None, answers)


def describe_resume_now(run: AgentRun) -> dict:
    """What a resume would do now (for the run page and the API)."""
    return decide_resume(run).as_dict()


# --- What the resumed run executes -----------------------------------------------------------------


@dataclass(frozen=True)
class ResumePlan:
    """The responses the resumed run appends (None: no call was left dangling) and where its scripts start."""

    responses: types.Content | None
    positions: dict[str, ScriptPosition]
    answers: tuple[Answer, ...] = ()
    # The final answer the original already gave (it stopped after answering, before it was
    # settled): the resume settles with it instead of asking the model for another one.
    final_text: str | None = None


class ResumeNoLongerPossible(RuntimeError):
    """Between the decision and the execution a dangling call became unanswerable (e.g. its journal went)."""


def resume_plan(run: AgentRun) -> ResumePlan:
    """For a run with `resume_of`: the answers to its predecessor's dangling calls, and its script positions."""
    original = AgentRun.objects.get(pk=run.resume_of_id)
    facts = gather_resume_facts(original)
    answers = answers_for(facts)
    in_doubt = [answer.call_id for answer in answers if answer.kind == IN_DOUBT]
    if in_doubt:
        raise ResumeNoLongerPossible(f"Calls {', '.join(in_doubt)} are in doubt: settle them, then resume again.")
    parts = [
        types.Part(function_response=types.FunctionResponse(id=answer.call_id, name=answer.tool_name,
                                                            response=answer.response))
        for answer in answers
    ]
    return ResumePlan(
        responses=types.Content(role="user", parts=parts) if parts else None,
        positions=script_positions(run, not_done={answer.call_id for answer in answers if answer.not_done}),
        answers=answers,
        final_text=None if answers else final_answer_given(original),
    )


def final_answer_given(run: AgentRun) -> str | None:
    """The text of `run`'s last event if it is an agent's final answer (text, no call, no error), else None."""
    rows = AdkEvent.objects.of_invocation(
        app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id, invocation_id=run.invocation_id
    ).values_list("event_data", flat=True)
    events = [data or {} for data in rows if not (data or {}).get("partial")]
    if not events:
        return None
    last = events[-1]
    if last.get("author") in (None, "", "user") or last.get("error_code") or _calls_of(last):
        return None
    text = "".join(part.get("text") or "" for part in _parts(last) if not part.get("thought"))
    return text or None


def script_positions(run: AgentRun, *, not_done: set[str]) -> dict[str, ScriptPosition]:
    """Each agent's scripted-model position after the turns recorded for the runs `run` resumes."""
    invocations = {ancestor.invocation_id for ancestor in chain_of(run)[1:]}
    turns: dict[str, list[dict]] = {}
    for invocation, data in _session_events(run):
        where = (data.get("custom_metadata") or {}).get(SCRIPT_STEP_KEY)
        if invocation not in invocations or not isinstance(where, dict) or data.get("partial"):
            continue
        turns.setdefault(data.get("author") or "", []).append(
            {**where, "call_ids": [call.get("id") for call in _calls_of(data)]}
        )
    suffix = f"~{run.run_id.hex[:8]}"
    return {agent: resume_position(agent_turns, not_done=not_done, id_suffix=suffix)
            for agent, agent_turns in turns.items()}
