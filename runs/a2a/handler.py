"""The A2A request handler whose task store is the ledger (docs/architecture.md, "ADK's own wires").

The a2a-sdk serves the protocol (JSON-RPC, the 1.0 methods and the 0.3 names, SSE, its errors);
this handler answers each method from the ledger's services: a new message starts a run (trigger
`a2a`, executed by a worker like any run, so a task survives the web server), a message on an
`input-required` task is the decision or result its run waits for (`runs.ledger.approvals`, through
`runs.adkwire.turns.answer_waiting`), `tasks/get` reads the run, `tasks/cancel` is
`runs.services.run.cancel_run`. The owner rule decides whose runs a caller may start and read.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.types import (
    AgentCard,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
)
from a2a.utils.errors import (
    ExtendedAgentCardNotConfiguredError,
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from asgiref.sync import sync_to_async
from google.adk.a2a import _compat
from google.adk.a2a.converters.part_converter import convert_a2a_part_to_genai_part
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.genai import types

from agents.adk import session_service
from agents.models import AdkSession
from config.lib.refusals import Refusal
from runs.a2a import tasks
from runs.adkwire import stream, turns
from runs.inputs import run_input
from runs.models.ledger import AgentRun, RunStatus, Trigger
from runs.refusals import RunAlreadySettled, RunNotFound
from runs.rules import permissions, visibility
from runs.services import run as services

CANCEL_WAIT_SECONDS = 15.0


def _refused(exc: Refusal) -> Exception:
    """A ledger refusal as the A2A error a client understands, its sentence kept."""
    if isinstance(exc, RunNotFound | turns.SessionNotFound):
        return TaskNotFoundError(message=exc.detail)
    return InvalidParamsError(message=exc.detail, data={"code": exc.code, **exc.context})


def _user(context: ServerCallContext) -> Any:
    return context.state["ledger_user"]


def _genai_content(message: Message) -> types.Content:
    parts: list[types.Part] = []
    for index, part in enumerate(message.parts):
        converted = convert_a2a_part_to_genai_part(part)
        for genai_part in converted if isinstance(converted, list) else [converted] if converted else []:
            if genai_part.text is None and genai_part.function_response is None:
                raise InvalidParamsError(
                    message=f"message.parts[{index}] is neither text nor a function response: the ledger's runs take "
                            "text, and a data part holding a function response answers a task that waits for input."
                )
            parts.append(genai_part)
    return types.Content(role="user", parts=parts)


class LedgerRequestHandler(RequestHandler):
    """One agent's A2A endpoint."""

    def __init__(self, agent: str, card: AgentCard):
        self.agent = agent
        self.card = card

    # --- Reading the ledger -------------------------------------------------------------------------

    def _run(self, task_id: str, actor: Any) -> AgentRun:
        try:
            run = visibility.get_visible_run(task_id, actor=actor)
        except RunNotFound:
            raise TaskNotFoundError(message=f"There is no task {task_id} of agent {self.agent!r} that you can see.") from None
        if run.agent_name != self.agent or not permissions.may_act_for_owner(user=actor, owner_id=run.owner_id):
            raise TaskNotFoundError(message=f"There is no task {task_id} of agent {self.agent!r} that you can see.")
        return run

    async def _task(self, run_id: Any) -> Task:
        return await sync_to_async(lambda: tasks.task_of(AgentRun.objects.get(pk=run_id)))()

    async def _settled(self, run: AgentRun) -> AgentRun:
        async for _ in stream.follow_raw(run, await sync_to_async(stream.seen_events)(run)):
            pass
        return await AgentRun.objects.aget(pk=run.run_id)

    # --- Starting or answering --------------------------------------------------------------------------

    def _owner(self, actor: Any, message: Message) -> str:
        wanted = _compat.meta_to_dict(message.metadata).get("owner_id") or actor.get_username()
        owner = run_input.clean_owner_id(wanted) if isinstance(wanted, str) else None
        if owner is None:
            raise InvalidParamsError(message="message.metadata.owner_id must be text: the end user the task acts for.")
        permissions.check_may_act_for_owner(user=actor, owner_id=owner)
        return owner

    def _session_for(self, owner: str, context_id: str) -> tuple[str, bool]:
        """(the session of the context, whether it must be created first)."""
        if not context_id:
            return str(uuid.uuid4()), True
        session_id = turns.clean_session_id(context_id)
        if AdkSession.objects.filter(app_name=self.agent, user_id=owner, id=session_id).exists():
            return session_id, False
        turns.check_new_session_id(session_id)
        return session_id, True

    async def _begin(self, params: SendMessageRequest, context: ServerCallContext) -> tuple[str, AgentRun, set[str]]:
        """The task, the run the message starts or the waiting run it answers, and the events already sent."""
        actor, message = _user(context), params.message
        content = _genai_content(message)
        answers = [part.function_response for part in content.parts if part.function_response]
        try:
            if message.task_id:
                run, seen = await sync_to_async(self._answer)(actor, message.task_id, content, answers)
                return message.task_id, run, seen
            if answers:
                raise InvalidParamsError(
                    message="A function response answers a task that waits for input: send it with that task's id."
                )
            meta = _compat.meta_to_dict(message.metadata)
            owner = await sync_to_async(self._owner)(actor, message)
            session_id, new = await sync_to_async(self._session_for)(owner, message.context_id)
            if new:
                try:
                    await session_service().create_session(app_name=self.agent, user_id=owner, session_id=session_id)
                except AlreadyExistsError:
                    pass  # a message of the same new context got there first: the session is there now
            run = await sync_to_async(turns.begin_turn)(
                actor=actor, app_name=self.agent, owner_id=owner, session_id=session_id, message=content,
                params=meta.get("params"), trigger=Trigger.A2A, enqueue=True,
            )
            return str(run.run_id), run, set()
        except Refusal as exc:
            raise _refused(exc) from None
        except services.ValidationError as exc:
            raise InvalidParamsError(message=" ".join(" ".join(m) for m in exc.message_dict.values())) from None

    def _answer(self, actor: Any, task_id: str, content: types.Content, answers: list) -> tuple[AgentRun, set[str]]:
        run = tasks.latest(self._run(task_id, actor))
        if run.status != RunStatus.WAITING:
            raise InvalidParamsError(
                message=f"Task {task_id} is {run.status}: it waits for "
                        "no input. Send a new message without a task id to start another task.",
                data={"code": "not_waiting", "status": run.status},
            )
        if not answers or any(part.text and part.text.strip() for part in content.parts):
            raise InvalidParamsError(
                message=f"Task {task_id} waits for input: answer with data parts holding the function response for "
                        "adk_request_confirmation ({\"confirmed\": true|false}) or for the long-running call, "
                        "with metadata adk_type=function_response, and nothing else.",
            )
        seen = stream.seen_events(run)
        turns.answer_waiting(actor=actor, run=run, responses=answers)
        return run, seen

    # --- The methods ----------------------------------------------------------------------------------

    async def on_message_send(self, params: SendMessageRequest, context: ServerCallContext) -> Task | Message:
        task_id, run, _ = await self._begin(params, context)
        if not params.configuration.return_immediately:
            await self._settled(run)
        return await self._task(task_id)

    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any]:
        task_id, run, seen = await self._begin(params, context)
        yield await self._task(task_id)
        async for item in self._updates(task_id, run, seen):
            yield item

    async def _updates(self, task_id: str, run: AgentRun, seen: set[str]) -> AsyncGenerator[Any]:
        async for data in stream.follow_raw(run, seen):
            message = await sync_to_async(tasks.event_message)(run, data, task_id=task_id)
            if message is not None:
                yield tasks.working_update(run, message, task_id=task_id)
        settled = await AgentRun.objects.aget(pk=run.run_id)
        if settled.status == RunStatus.SUCCESS:
            yield tasks.result_update(settled, task_id=task_id)
        yield await sync_to_async(lambda: tasks.status_update(settled, tasks.status_of(settled), task_id=task_id))()

    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task | None:
        return await sync_to_async(lambda: tasks.task_of(self._run(params.id, _user(context))))()

    async def on_cancel_task(self, params: CancelTaskRequest, context: ServerCallContext) -> Task | None:
        actor = _user(context)
        run = await sync_to_async(lambda: tasks.latest(self._run(params.id, actor)))()
        try:
            await sync_to_async(services.cancel_run)(run.run_id, actor=actor)
        except RunAlreadySettled:
            raise TaskNotCancelableError(
                message=f"Task {params.id} is {run.status} already: only a working or input-required task can be canceled."
            ) from None
        except Refusal as exc:
            raise _refused(exc) from None
        # A running run stops at its next heartbeat: answer once it has (or as it stands then).
        try:
            await asyncio.wait_for(self._settled(run), CANCEL_WAIT_SECONDS)
        except TimeoutError:
            pass
        return await self._task(params.id)

    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any]:
        run = await sync_to_async(lambda: tasks.latest(self._run(params.id, _user(context))))()
        if run.status not in stream.GOING_ON:
            raise UnsupportedOperationError(message=f"Task {params.id} is no longer working: read it with tasks/get.")
        yield await self._task(params.id)
        async for item in self._updates(params.id, run, await sync_to_async(stream.seen_events)(run)):
            yield item

    async def on_list_tasks(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        raise UnsupportedOperationError(
            message="tasks/list is not served here: list runs with GET /api/runs/?agent=<agent>&trigger=a2a."
        )

    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError(message="Push notifications are not supported: poll tasks/get.")

    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError(message="Push notifications are not supported: poll tasks/get.")

    async def on_list_task_push_notification_configs(
        self, params: ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> ListTaskPushNotificationConfigsResponse:
        raise PushNotificationNotSupportedError(message="Push notifications are not supported: poll tasks/get.")

    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        raise PushNotificationNotSupportedError(message="Push notifications are not supported: poll tasks/get.")

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> AgentCard:
        raise ExtendedAgentCardNotConfiguredError(message="This agent has no extended card.")
