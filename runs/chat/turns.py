"""Chat turns as runs.

A turn is an `AgentRun` with trigger `chat`, written before anything executes like every other
run, and executed in the web process on the server's event loop so its events can be streamed
as they happen. A conversation keeps one ADK session across its turns, so each turn sees the
history; the run's `tools_executed` still counts only its own calls (its journal, or the
session events of its own invocation).

A replay of a chat turn is an ordinary replay: a new run in a fresh session. It never runs in
the conversation, and it does not occupy it (only runs in the conversation's session do).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import uuid
from collections.abc import Coroutine
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from google.adk.events.event import Event

from agents import faults
from agents.registry import UnknownAgentError
from agents.services import resolve_runnable
from config.lib.refusals import Refusal
from config.lib.user_params import scripts_refusal
from runs.execution import executor
from runs.inputs import run_input
from runs.ledger import outcomes
from runs.models.chat import Conversation
from runs.models.ledger import UNSETTLED, AgentRun, Trigger
from runs.rules import permissions
from runs.rules.public_text import public_error_message
from runs.services import run as services

logger = logging.getLogger(__name__)


class ChatRefusal(Refusal):
    """A turn that cannot start."""

    code = "refused"
    status = 400


class ConversationNotFound(ChatRefusal):
    code = "conversation_not_found"
    status = 404


class ConversationBusy(ChatRefusal):
    code = "conversation_busy"
    status = 409


def _conversation_uuid(conversation_id: Any) -> uuid.UUID:
    try:
        return uuid.UUID(str(conversation_id))
    except ValueError:
        raise ValidationError(
            {"conversation_id": f"conversation_id {conversation_id!r} is not a conversation id (a UUID)."}
        ) from None


def begin_turn(
    *,
    user: Any,
    agent_name: str,
    owner_id: str,
    message: str,
    conversation_id: Any = None,
    params: dict | None = None,
) -> AgentRun:
    """Write one chat turn as a queued run in its conversation (a new one without an id).

    Raises ValidationError for bad input, OwnerNotPermitted when the user may not act for the
    owner (`runs.rules.permissions`), ConversationNotFound when the conversation is not this user's
    (for this agent and owner), ConversationBusy while another turn of it runs.
    Nothing is written when it raises.
    """
    # What identifies the conversation is checked first, so a bad agent or owner is a 400 and
    # not a conversation that "does not exist"; start_run checks the rest.
    errors: dict[str, list[str]] = {}
    try:
        if not isinstance(agent_name, str) or not agent_name:
            raise ValidationError({"agent": "agent is required: the name of a registered agent."})
        # A workflow can be chatted with too: each turn runs the whole graph in the conversation.
        resolve_runnable(agent_name)
    except UnknownAgentError as exc:
        errors["agent"] = [str(exc)]
    except ValidationError as exc:
        errors.update(exc.message_dict)
    try:
        owner_key = run_input.clean_owner_id(owner_id)
    except ValidationError as exc:
        errors.update(exc.message_dict)
    wanted = None
    if conversation_id not in (None, ""):
        try:
            wanted = _conversation_uuid(conversation_id)
        except ValidationError as exc:
            errors.update(exc.message_dict)
    # A turn runs in the web process: what would kill that process is refused before anything is written.
    refused = scripts_refusal(params) or faults.refused_in_web_process(params)
    if refused:
        errors["params"] = [refused]
    if errors:
        raise ValidationError(errors)
    # Before the conversation is looked up: a conversation of this user's for an owner they may
    # no longer act for (a grant taken back) is refused like a new one.
    permissions.check_may_act_for_owner(user=user, owner_id=owner_key)

    with transaction.atomic():
        if wanted is None:
            conversation = Conversation(
                agent_name=agent_name, owner_id=owner_key, created_by=user, session_id=str(uuid.uuid4())
            )
        else:
            # The lock makes a second, simultaneous turn wait here and then see the first one.
            conversation = (
                Conversation.objects.select_for_update()
                .filter(pk=wanted, created_by=user, agent_name=agent_name, owner_id=owner_key)
                .first()
            )
            if conversation is None:
                raise ConversationNotFound(
                    f"There is no conversation {wanted} of agent {agent_name!r} for owner {owner_key!r} "
                    "started by you."
                )
            busy = (
                AgentRun.objects.filter(
                    conversation_id=str(conversation.pk),
                    session_id=conversation.session_id,
                    status__in=UNSETTLED,
                )
                .values_list("run_id", flat=True)
                .first()
            )
            if busy is not None:
                raise ConversationBusy(
                    f"Conversation {conversation.pk} is still answering an earlier message (run {busy}); "
                    "wait for it to finish or cancel it.",
                    run_id=str(busy),
                )
        run = services.start_run(
            agent_name=agent_name,
            message=message,
            owner_id=owner_id,
            params=params,
            created_by=user,
            trigger=Trigger.CHAT,
            conversation_id=str(conversation.pk),
            session_id=conversation.session_id,
            enqueue=False,
        )
        if wanted is None:
            conversation.save(force_insert=True)
    return run


# --- Executing a turn on the server's event loop ------------------------------------------------------

END = object()
# Running turns are referenced here: the loop keeps only weak references to tasks, and a turn
# must finish settling even after its client (and its response) is gone.
_running: set[asyncio.Task] = set()


def event_json(event: Event) -> dict:
    return event.model_dump(mode="json", exclude_none=True, by_alias=True)


def _in_fresh_context(coro: Coroutine) -> asyncio.Task:
    # A task started from a request would inherit that request's thread for database work
    # (asgiref's ThreadSensitiveContext), which Django discards when the response ends, while
    # the run may still be settling. A fresh context uses the process's ORM thread instead.
    task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task


class ChatTurn:
    """One chat turn being executed: its events as they come, and the way to abandon it."""

    def __init__(self, run: AgentRun):
        self.run = run
        self.control = executor.RunControl(run.run_id)
        self.events: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = _in_fresh_context(self._execute())

    async def _execute(self) -> outcomes.Outcome | None:
        try:
            return await executor.aexecute(self.run.run_id, self.control, on_event=self._push)
        finally:
            self.events.put_nowait(END)

    def _push(self, event: Event) -> None:
        self.events.put_nowait(event_json(event))

    @property
    def finished(self) -> bool:
        return self.task is not None and self.task.done()

    def abandon(self) -> None:
        """The client is gone: abort the invocation so pending calls are sealed, settle `cancelled`."""
        if not self.finished:
            self.control.abort(outcomes.CLIENT_DISCONNECTED)


def start_abandoned(run: AgentRun) -> None:
    """A turn written while its client left: run it only to settle it as cancelled, tools []."""
    turn = ChatTurn(run)
    turn.control.abort(outcomes.CLIENT_DISCONNECTED)
    turn.start()


def outcome_payload(run: AgentRun) -> dict:
    return {
        "run_id": str(run.run_id),
        "conversation_id": run.conversation_id,
        "session_id": run.session_id,
        "status": run.status,
        "error_code": run.error_code,
        "error_message": public_error_message(
            error_code=run.error_code, error_message=run.error_message, worker=run.worker
        ),
        "result": run.result,
        "tools_executed": run.tools_executed,
        "model_retries": run.model_retries,
    }


def sse(event: str, data: Any, *, event_id: str | None = None) -> bytes:
    lines = [f"event: {event}"]
    if event_id:
        lines.append(f"id: {event_id}")
    lines.append(f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}")
    return ("\n".join(lines) + "\n\n").encode()
