"""A run as an A2A task: the ledger is the task store (docs/architecture.md, "ADK's own wires").

A task's id is its run's id, its context the run's session; its state is read from the run
(queued/running → working, waiting → input-required, success → completed, error → failed,
cancelled → canceled), so `tasks/get` answers from the ledger after any restart. Parts are
converted by ADK's own A2A converters, so a waiting call reaches the caller as ADK's `to_a2a`
sends it: a data part holding the `adk_request_confirmation` (or long-running) function call,
marked long-running.
"""

from __future__ import annotations

import uuid
from typing import Any

from a2a.types import (
    Artifact,
    Message,
    Part,
    Role,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from google.adk.a2a import _compat
from google.adk.a2a.converters.part_converter import (
    A2A_DATA_PART_METADATA_IS_LONG_RUNNING_KEY,
    convert_genai_part_to_a2a_part,
)
from google.adk.a2a.converters.utils import _get_adk_metadata_key
from google.adk.events.event import Event
from google.genai import types

from agents.models import AdkEvent
from runs.models.approvals import PendingCall
from runs.models.ledger import AgentRun, RunStatus
from runs.rules.public_text import public_error_message

STATES = {
    RunStatus.QUEUED: TaskState.TASK_STATE_WORKING,
    RunStatus.RUNNING: TaskState.TASK_STATE_WORKING,
    RunStatus.WAITING: TaskState.TASK_STATE_INPUT_REQUIRED,
    RunStatus.SUCCESS: TaskState.TASK_STATE_COMPLETED,
    RunStatus.ERROR: TaskState.TASK_STATE_FAILED,
    RunStatus.CANCELLED: TaskState.TASK_STATE_CANCELED,
}
LONG_RUNNING = _get_adk_metadata_key(A2A_DATA_PART_METADATA_IS_LONG_RUNNING_KEY)


def a2a_parts(parts: list[types.Part], *, long_running: set[str] = frozenset()) -> list[Part]:
    """GenAI parts as ADK's converters write them; a long-running call's part marked as such."""
    converted: list[Part] = []
    for part in parts:
        if part.thought:
            continue
        result = convert_genai_part_to_a2a_part(part)
        for a2a_part in result if isinstance(result, list) else [result] if result else []:
            if part.function_call and part.function_call.id in long_running:
                metadata = _compat.part_metadata(a2a_part)
                metadata[LONG_RUNNING] = True
                _compat.set_part_metadata(a2a_part, metadata)
            converted.append(a2a_part)
    return converted


def agent_message(run: AgentRun, parts: list[Part], *, task_id: str = "") -> Message:
    return Message(message_id=str(uuid.uuid4()), role=Role.ROLE_AGENT, parts=parts,
                   task_id=task_id or str(run.run_id), context_id=run.session_id)


def text_message(run: AgentRun, text: str) -> Message:
    return agent_message(run, [Part(text=text)])


def event_message(run: AgentRun, data: dict, *, task_id: str = "") -> Message | None:
    """One stored ADK event of the run as the agent's message, or None when it carries nothing to say."""
    event = Event.model_validate(data)
    if event.author == "user" or not event.content or not event.content.parts:
        return None
    parts = a2a_parts(event.content.parts, long_running=set(event.long_running_tool_ids or ()))
    return agent_message(run, parts, task_id=task_id) if parts else None


def waiting_parts(run: AgentRun) -> list[Part]:
    """The calls a waiting run asks about, as the data parts ADK's `to_a2a` ends an input-required task with."""
    asked = {call.request_call_id or call.call_id for call in PendingCall.objects.filter(run_id=run.run_id, decision="")}
    parts: list[Part] = []
    for data in AdkEvent.objects.of_invocation(
        app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id, invocation_id=run.invocation_id
    ).values_list("event_data", flat=True):
        event = Event.model_validate(data or {})
        calls = [part for part in (event.content.parts if event.content else None) or []
                 if part.function_call and part.function_call.id in asked]
        parts.extend(a2a_parts(calls, long_running=asked))
    return parts


def status_of(run: AgentRun) -> TaskStatus:
    status = TaskStatus(state=STATES[run.status])
    status.timestamp.FromDatetime(run.finished_at or run.started_at or run.created_at)
    if run.status == RunStatus.WAITING:
        status.message.CopyFrom(agent_message(run, waiting_parts(run)))
    elif run.status in (RunStatus.ERROR, RunStatus.CANCELLED):
        said = public_error_message(error_code=run.error_code, error_message=run.error_message, worker=run.worker)
        status.message.CopyFrom(text_message(run, f"{run.error_code}: {said}" if run.error_code else said))
    return status


def result_artifact(run: AgentRun) -> Artifact:
    return Artifact(artifact_id=f"{run.run_id}-result", name="result", parts=[Part(text=run.result or "")])


def metadata(run: AgentRun) -> dict[str, Any]:
    return {
        "run_id": str(run.run_id), "agent": run.agent_name, "owner_id": run.owner_id,
        _get_adk_metadata_key("app_name"): run.agent_name, _get_adk_metadata_key("user_id"): run.owner_id,
        _get_adk_metadata_key("session_id"): run.session_id,
    }


def latest(run: AgentRun) -> AgentRun:
    """The run that carries the task on now: a run that died and was continued (a resume, by the
    system's recovery or a person) lives on in its resume, in the same session."""
    seen = {run.run_id}
    while (following := AgentRun.objects.filter(resume_of=run).order_by("-created_at").first()) is not None:
        if following.run_id in seen:
            break
        seen.add(following.run_id)
        run = following
    return run


def task_of(run: AgentRun) -> Task:
    """The run, read now, as its task: its id, and the state of the run that carries it on now."""
    current = latest(run)
    task = Task(id=str(run.run_id), context_id=run.session_id, status=status_of(current))
    if current.status == RunStatus.SUCCESS:
        task.artifacts.append(result_artifact(current))
    _compat.set_struct_metadata(task, {**metadata(run), "current_run_id": str(current.run_id)})
    return task


def status_update(run: AgentRun, status: TaskStatus, *, task_id: str = "") -> TaskStatusUpdateEvent:
    update = TaskStatusUpdateEvent(task_id=task_id or str(run.run_id), context_id=run.session_id, status=status)
    _compat.set_struct_metadata(update, metadata(run))
    return update


def working_update(run: AgentRun, message: Message, *, task_id: str = "") -> TaskStatusUpdateEvent:
    return status_update(run, TaskStatus(state=TaskState.TASK_STATE_WORKING, message=message), task_id=task_id)


def result_update(run: AgentRun, *, task_id: str = "") -> TaskArtifactUpdateEvent:
    return TaskArtifactUpdateEvent(task_id=task_id or str(run.run_id), context_id=run.session_id,
                                   artifact=result_artifact(run), last_chunk=True)
