"""Approvals and tools that wait, durable (docs/architecture.md, "Approvals and tools that wait").

ADK lets a tool ask a person first (`FunctionTool(require_confirmation=…)`,
`tool_context.request_confirmation()`) and lets a tool answer later (`LongRunningFunctionTool`).
Either way the invocation ends with calls nobody has answered yet. Here that is a state of the
run, not of a process:

- **Parking.** When a run's invocation ends with such calls (`waits_in`), the worker does not settle
  it: `park_run` moves it `running → waiting` (conditional on the lease of the claim that ran it) and writes one
  `PendingCall` per call, bound to the call's id and arguments as asked. The run holds no slot and no
  heartbeat, and the reconciler, which only reads `running` rows, never touches it.
- **Answering** is a decision (`runs.services.decisions`: `decide_call`, `give_result`, the timeout's
  `expire_waiting`): it takes the answer once and, when the run waits for nothing more, queues it.
- **Continuing as the same run.** The worker claims it again (`attempts + 1`); the executor sends
  the answers as the new message (`continuation`): ADK's confirmation processor pairs each decision
  with its `adk_request_confirmation` call, runs an approved tool under every rule (journal, effect
  record) or answers a rejected one "This tool call is rejected.", and a long-running call's result
  reaches the model as its response. The calls' ids belong to the run's own invocation, so ADK's
  routing of function responses (`Runner._resolve_invocation_id_from_fr`) keeps it there.
- **Cancel.** `cancel_waiting` closes the open calls and settles the run `cancelled`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.utils import timezone
from google.adk.events.event import Event
from google.adk.tools.tool_confirmation import ToolConfirmation
from google.adk.utils._function_call_names import REQUEST_CONFIRMATION_FUNCTION_CALL_NAME
from google.genai import types

from agents import faults
from agents.models import AdkEvent
from agents.scripted import FAULT_KEYS, SCRIPT_STEP_KEY, ScriptPosition, resume_position
from runs.ledger import journal, leases
from runs.models.approvals import Decision, PendingCall, WaitKind
from runs.models.ledger import AgentRun, RunStatus, ToolCall, ToolCallStatus

logger = logging.getLogger(__name__)


# --- What an invocation waits for ------------------------------------------------------------------


@dataclass(frozen=True)
class Wait:
    kind: str
    call_id: str
    tool_name: str
    args: dict = field(default_factory=dict)
    agent_name: str = ""
    request_call_id: str = ""
    hint: str = ""
    payload_asked: Any = None


def waits_in(events: list[Event]) -> list[Wait]:
    """The calls an invocation's events leave waiting: confirmation requests and long-running calls
    with no response among them (a long-running tool that answered at once has answered)."""
    answered = {response.id for event in events for response in event.get_function_responses() if response.id}
    waits: list[Wait] = []
    for event in events:
        long_running = event.long_running_tool_ids or set()
        for call in event.get_function_calls():
            if not call.id or call.id not in long_running or call.id in answered:
                continue
            if call.name == REQUEST_CONFIRMATION_FUNCTION_CALL_NAME:
                original = (call.args or {}).get("originalFunctionCall") or {}
                asked = (call.args or {}).get("toolConfirmation") or {}
                if not original.get("id"):
                    continue
                waits.append(Wait(
                    WaitKind.CONFIRMATION, original["id"], original.get("name") or "", original.get("args") or {},
                    event.author or "", call.id, asked.get("hint") or "", asked.get("payload"),
                ))
            else:
                waits.append(Wait(WaitKind.RESULT, call.id, call.name or "", dict(call.args or {}), event.author or ""))
    return waits


def asks_confirmation(event: Event) -> list[str]:
    """The tools a confirmation request in `event` is about (empty when it asks nothing)."""
    return [
        ((call.args or {}).get("originalFunctionCall") or {}).get("name") or ""
        for call in event.get_function_calls() if call.name == REQUEST_CONFIRMATION_FUNCTION_CALL_NAME
    ]


# --- Parking a run -----------------------------------------------------------------------------------


def park_run(*, run: AgentRun, waits: list[Wait], result: str = "") -> bool:
    """Move the run `running → waiting` with the calls it waits for; False if this attempt no longer holds it.

    `run` is the row as claimed: the write is conditional on the run still running under its
    lease (`runs.ledger.leases`), so a worker that lost the run (reconciled, settled by someone else) writes nothing.
    """
    now = timezone.now()
    with transaction.atomic():
        parked = leases.held(run_id=run.run_id, lease=run.lease).update(
            status=RunStatus.WAITING,
            tools_executed=journal.derive_tools_executed(run),
            result=result,
            heartbeat_at=None,
        )
        if not parked:
            logger.warning("Run %s asked to wait after it was no longer held under its lease", run.run_id)
            return False
        for wait in waits:
            PendingCall.objects.update_or_create(
                run_id=run.run_id, call_id=wait.call_id,
                defaults={
                    "kind": wait.kind, "request_call_id": wait.request_call_id, "tool_name": wait.tool_name,
                    "agent_name": wait.agent_name, "args": wait.args, "hint": wait.hint,
                    "payload_asked": wait.payload_asked, "asked_at": now, "decision": "", "decided_by": None,
                    "decided_at": None, "note": "", "by_system": False, "payload": None, "delivered_attempt": None,
                },
            )
        # A call asked of a person has not run: ADK answered it with its request, not the tool's answer.
        asked = [wait.call_id for wait in waits if wait.kind == WaitKind.CONFIRMATION]
        if asked:
            ToolCall.objects.filter(run_id=run.run_id, call_id__in=asked).update(
                status=ToolCallStatus.WAITING, answered_at=None, response_summary="waiting for a person's approval",
            )
            AgentRun.objects.filter(pk=run.run_id).update(tools_executed=journal.derive_tools_executed(run))
    logger.info("Run %s waits for %d call(s): %s", run.run_id, len(waits),
                ", ".join(f"{wait.tool_name} {wait.call_id}" for wait in waits))
    return True


# --- Calls that will not run; cancelling a run that waits ------------------------------------------


def mark_never_ran(*, run_id: Any, call_ids: list[str], why: str) -> None:
    """The journal rows of calls a person was asked about and that will never run now."""
    ToolCall.objects.filter(run_id=run_id, call_id__in=call_ids, status=ToolCallStatus.WAITING).update(
        status=ToolCallStatus.NOT_RUN, response_summary=why[:500]
    )


def close_for_cancel(*, run: AgentRun, actor: Any) -> int:
    """The run was cancelled while it waited: its open calls are closed, recorded as such."""
    user = actor if getattr(actor, "is_authenticated", False) else None
    open_calls = PendingCall.objects.filter(run_id=run.run_id, decision="")
    mark_never_ran(run_id=run.run_id, call_ids=list(open_calls.values_list("call_id", flat=True)),
               why="closed unanswered (the run was cancelled): not run")
    return open_calls.update(
        decision=Decision.CANCELLED, decided_by=user, decided_at=timezone.now(), note="The run was cancelled."
    )


def cancel_waiting(*, run: AgentRun, actor: Any, now: Any) -> bool:
    """Settle a waiting run `cancelled` (the caller holds its row lock); False if it no longer waits."""
    user = actor if getattr(actor, "is_authenticated", False) else None
    cancelled = AgentRun.objects.filter(pk=run.pk, status=RunStatus.WAITING).update(
        status=RunStatus.CANCELLED,
        error_code="cancelled",
        error_message="The run was cancelled while it waited for a decision; the calls it waited for never ran.",
        tools_executed=journal.derive_tools_executed(run),
        finished_at=now,
        cancel_requested_at=now,
        cancel_requested_by=user,
    )
    if cancelled:
        close_for_cancel(run=run, actor=actor)
    return bool(cancelled)


# --- Continuing the run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Continuation:
    """What a waiting run's next attempt sends ADK: the answers, and where its scripted models go on."""

    message: types.Content
    positions: dict[str, ScriptPosition]
    call_ids: tuple[str, ...]


def response_for(pending: PendingCall) -> types.FunctionResponse:
    if pending.kind == WaitKind.CONFIRMATION:
        confirmation = ToolConfirmation(
            hint=pending.hint, confirmed=pending.decision == Decision.APPROVE,
            payload=pending.payload if pending.payload is not None else pending.payload_asked,
        )
        return types.FunctionResponse(
            id=pending.request_call_id, name=REQUEST_CONFIRMATION_FUNCTION_CALL_NAME,
            response=confirmation.model_dump(by_alias=True),
        )
    result = pending.payload if isinstance(pending.payload, dict) else {"result": pending.payload}
    return types.FunctionResponse(id=pending.call_id, name=pending.tool_name, response=result)


def _run_events(run: AgentRun) -> list[dict]:
    rows = AdkEvent.objects.filter(
        app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id, invocation_id=run.invocation_id
    ).order_by("timestamp", "id").values_list("event_data", flat=True)
    return [data or {} for data in rows]


def _answered_in_session(events: list[dict]) -> set[str]:
    return {
        (part.get("function_response") or {}).get("id")
        for data in events if data.get("author") == "user"
        for part in (data.get("content") or {}).get("parts") or [] if part.get("function_response")
    }


def continuation(run: AgentRun) -> Continuation | None:
    """For a run claimed again after it waited: the answers it has not yet handed ADK, or None."""
    answered = list(PendingCall.objects.filter(run_id=run.run_id).exclude(decision="").exclude(
        decision=Decision.CANCELLED).order_by("asked_at", "pk"))
    if not answered:
        return None
    events = _run_events(run)
    in_session = _answered_in_session(events)
    due = [
        pending for pending in answered
        if (pending.request_call_id or pending.call_id) not in in_session
    ]
    if not due:
        return None
    parts = [types.Part(function_response=response_for(pending)) for pending in due]
    _rearm_scripted_faults(run, events, [pending.call_id for pending in due if pending.decision == Decision.APPROVE])
    return Continuation(
        message=types.Content(role="user", parts=parts),
        positions=_positions(run, events),
        call_ids=tuple(pending.call_id for pending in due),
    )


def _positions(run: AgentRun, events: list[dict]) -> dict[str, ScriptPosition]:
    """Each scripted agent's next step after the turns this run (and any run it resumes) already played."""
    turns: dict[str, list[dict]] = {}
    for data in _chain_events(run, events):
        where = (data.get("custom_metadata") or {}).get(SCRIPT_STEP_KEY)
        if not isinstance(where, dict) or data.get("partial"):
            continue
        turns.setdefault(data.get("author") or "", []).append({**where, "call_ids": []})
    return {agent: resume_position(agent_turns, not_done=(), id_suffix="") for agent, agent_turns in turns.items()}


def _chain_events(run: AgentRun, events: list[dict]) -> list[dict]:
    if run.resume_of_id is None:
        return events
    # A resumed run's script went on from its predecessors' steps: theirs count too.
    return list(AdkEvent.objects.filter(
        app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id
    ).order_by("timestamp", "id").values_list("event_data", flat=True))


def _rearm_scripted_faults(run: AgentRun, events: list[dict], call_ids: list[str]) -> None:
    """A scripted call's fault (e.g. a crash inside the tool) belongs to the call, wherever its tool finally runs.

    The scripted model arms a fault when it makes the call, in the process that asked for the
    confirmation; an approved call runs in a later attempt, maybe in another process, so its fault is
    armed again there from the step recorded with the call's event.
    """
    wanted = set(call_ids)
    for data in events:
        where = (data.get("custom_metadata") or {}).get(SCRIPT_STEP_KEY)
        if not wanted or not isinstance(where, dict):
            continue
        calls = [part["function_call"] for part in (data.get("content") or {}).get("parts") or []
                 if part.get("function_call")]
        script = (run.params.get("scripts") or {}).get(data.get("author") or "") or run.params.get("script") or []
        step_index = where.get("step")
        if not isinstance(step_index, int) or not 0 <= step_index < len(script):
            continue
        step = script[step_index]
        for call, position in zip(calls, where.get("calls") or [], strict=False):
            if call.get("id") not in wanted:
                continue
            chosen = step[position] if isinstance(step, list) and position < len(step) else step
            fault = {key: chosen[key] for key in FAULT_KEYS if isinstance(chosen, dict) and key in chosen}
            if fault:
                faults.arm(call["id"], fault)


def mark_delivered(*, run: AgentRun, call_ids: tuple[str, ...]) -> None:
    """Before ADK gets the answers: an approved call is about to run, so its journal row says `called` again
    (journal first: a worker that dies inside the tool leaves it in doubt, never silently answered).
    Written only while this attempt holds the run (`runs.ledger.leases.hold`)."""
    with transaction.atomic():
        leases.hold(run_id=run.run_id, lease=run.lease, what="the answers' delivery")
        PendingCall.objects.filter(run_id=run.run_id, call_id__in=call_ids).update(delivered_attempt=run.attempts)
        approved = PendingCall.objects.filter(
            run_id=run.run_id, call_id__in=call_ids, decision=Decision.APPROVE
        ).values_list("call_id", flat=True)
        ToolCall.objects.filter(run_id=run.run_id, call_id__in=list(approved)).update(
            status=ToolCallStatus.CALLED, answered_at=None, response_summary="approved: running",
        )


# --- Reading ---------------------------------------------------------------------------------------------


def pending_calls_of(run: AgentRun) -> list[PendingCall]:
    return list(PendingCall.objects.filter(run_id=run.run_id).select_related("decided_by").order_by("asked_at", "pk"))
