"""Executing one claimed run: the ADK runner, the heartbeat, and the outcome.

The agent runs on the process's long-lived agent loop (`agents.adk.run_coroutine`). The
heartbeat runs in a plain thread, so a tool that blocks the loop cannot make a live run look
dead, and it carries cancellation and the run's time limit back into the loop as ADK's abort
signal, which seals pending calls instead of leaving them dangling.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections, connection
from google.adk.agents.run_config import RunConfig
from google.adk.apps import App
from google.adk.runners import Runner
from google.genai import errors as genai_errors
from google.genai import types

from agents.adk import refresh_orm_thread_connections, run_coroutine, session_service
from agents.registry import build_agent, get_agent_spec
from agents.scripted import ScriptedModelError
from memory.adk import memory_service
from memory.services import remember_run
from runs import services
from runs.journal import JournalPlugin
from runs.models import AgentRun, RunStatus

logger = logging.getLogger(__name__)


@dataclass
class Outcome:
    status: str
    error_code: str = ""
    error_message: str = ""
    result: str = ""


class RunControl:
    """The heartbeat thread of one run, and its way to abort the run's ADK invocation."""

    def __init__(self, run_id: uuid.UUID):
        self.run_id = run_id
        self.abort_reason: str | None = None
        self.cancelled_by_request = False
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abort_event: asyncio.Event | None = None
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{run_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def attach(self, loop: asyncio.AbstractEventLoop, abort_event: asyncio.Event) -> None:
        self._loop, self._abort_event = loop, abort_event
        if self.abort_reason is not None:
            loop.call_soon_threadsafe(abort_event.set)

    def abort(self, reason: str) -> None:
        if self.abort_reason is not None:
            return
        self.abort_reason = reason
        if self._loop is not None and self._abort_event is not None:
            self._loop.call_soon_threadsafe(self._abort_event.set)

    def _run(self) -> None:
        try:
            while not self._stop.wait(settings.RUN_HEARTBEAT_SECONDS):
                self._beat_once()
        finally:
            connection.close()

    def _beat_once(self) -> None:
        try:
            services.beat(run_id=self.run_id)
            cancel_requested = (
                AgentRun.objects.filter(pk=self.run_id)
                .values_list("cancel_requested_at", flat=True)
                .first()
            )
        except Exception:
            # A database hiccup must not kill the run; the next beat tries again.
            logger.exception("Run %s: heartbeat failed", self.run_id)
            close_old_connections()
            return
        if cancel_requested is not None:
            self.cancelled_by_request = True
            self.abort("cancel_requested")
        elif time.monotonic() - self._started > settings.RUN_TIMEOUT_SECONDS:
            self.abort("timeout")


def user_content(run: AgentRun) -> types.Content:
    parts = [types.Part(text=run.message)]
    if run.input_file:
        data = Path(run.input_file).read_bytes()
        mime_type = mimetypes.guess_type(run.input_file_name)[0] or "application/octet-stream"
        parts.append(types.Part(inline_data=types.Blob(mime_type=mime_type, data=data, display_name=run.input_file_name)))
    return types.Content(role="user", parts=parts)


def _final_text(event) -> str:
    if not event.content or not event.content.parts:
        return ""
    return "".join(part.text or "" for part in event.content.parts if not getattr(part, "thought", False))


def describe_exception(exc: BaseException, plugin: JournalPlugin) -> Outcome:
    tool_error = next((e for e in plugin.tool_errors.values() if e is exc), None)
    if tool_error is not None:
        return Outcome(RunStatus.ERROR, "tool_failed", f"A tool failed: {type(exc).__name__}: {exc}")
    if isinstance(exc, genai_errors.ClientError) and exc.code == 429:
        return Outcome(
            RunStatus.ERROR,
            "rate_limited",
            f"The model provider rate-limited the run (429 {exc.status or 'RESOURCE_EXHAUSTED'}).",
        )
    if isinstance(exc, genai_errors.APIError | ScriptedModelError):
        return Outcome(RunStatus.ERROR, "model_error", f"The model call failed: {exc}")
    return Outcome(RunStatus.ERROR, "agent_error", f"{type(exc).__name__}: {exc}")


EMPTY_TURN_MESSAGE = "The model returned an empty answer, so the run stopped without a result."


async def run_agent(run: AgentRun, control: RunControl) -> Outcome:
    spec = get_agent_spec(run.agent_name)
    plugin = JournalPlugin(run.run_id)
    app = App(name=spec.name, root_agent=build_agent(spec, params=run.params), plugins=[plugin])
    sessions = session_service()
    session = await sessions.get_session(app_name=spec.name, user_id=run.owner_id, session_id=run.session_id)
    if session is None:
        await sessions.create_session(app_name=spec.name, user_id=run.owner_id, session_id=run.session_id)
    runner = Runner(app=app, session_service=sessions, memory_service=memory_service())
    abort_event = asyncio.Event()
    control.attach(asyncio.get_running_loop(), abort_event)
    texts: list[str] = []
    last_error: tuple[str, str] | None = None
    try:
        async for event in runner.run_async(
            user_id=run.owner_id,
            session_id=run.session_id,
            invocation_id=run.invocation_id,
            new_message=user_content(run),
            run_config=RunConfig(custom_metadata={"run_id": str(run.run_id)}),
            abort_signal=abort_event,
        ):
            if event.partial:
                continue
            if event.error_code:
                last_error = (event.error_code, event.error_message or "")
            if event.author != "user" and event.is_final_response():
                text = _final_text(event)
                if text:
                    texts.append(text)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the run's recorded outcome
        if control.abort_reason is None:
            logger.info("Run %s failed: %r", run.run_id, exc)
            return describe_exception(exc, plugin)
    finally:
        await runner.close()

    if control.abort_reason == "cancel_requested":
        return Outcome(RunStatus.CANCELLED, "cancelled", "The run was cancelled on request.")
    if control.abort_reason == "timeout":
        return Outcome(
            RunStatus.ERROR,
            "timeout",
            f"The run exceeded its time limit of {settings.RUN_TIMEOUT_SECONDS} s (RUN_TIMEOUT_SECONDS) and was stopped.",
        )
    if last_error is not None:
        code, message = last_error
        if code == "MODEL_RETURNED_NO_CONTENT":
            return Outcome(RunStatus.ERROR, "empty_turn", EMPTY_TURN_MESSAGE)
        if code != "INVOCATION_ABORTED":
            return Outcome(RunStatus.ERROR, code.lower()[:64], message or code)
    return Outcome(RunStatus.SUCCESS, result="\n".join(texts))


def execute(run_id: uuid.UUID) -> str:
    """Claim and run one run; safe to call twice (the second call finds nothing to claim)."""
    if not services.claim_run(run_id=run_id, worker=services.worker_name()):
        logger.info("Run %s was not claimed: it is no longer queued", run_id)
        return "not claimed"
    refresh_orm_thread_connections()
    control = RunControl(run_id)
    outcome = Outcome(RunStatus.ERROR, "internal", "The worker stopped before the run finished.")
    control.start()
    try:
        run = AgentRun.objects.get(pk=run_id)
        outcome = run_coroutine(run_agent(run, control))
    except Exception as exc:  # noqa: BLE001
        logger.exception("Run %s: execution failed", run_id)
        outcome = Outcome(RunStatus.ERROR, "internal", f"The worker could not run the agent: {type(exc).__name__}: {exc}")
    finally:
        control.stop()
        settled = services.settle_run(
            run_id=run_id,
            status=outcome.status,
            error_code=outcome.error_code,
            error_message=outcome.error_message,
            result=outcome.result,
        )
    if settled and outcome.status == RunStatus.SUCCESS:
        _remember(run_id)
    return outcome.status


def _remember(run_id: uuid.UUID) -> None:
    # The run has succeeded and is recorded so: failing to remember it must not change that.
    try:
        remember_run(run_id=run_id)
    except Exception:  # noqa: BLE001
        logger.exception("Run %s: its conversation could not be added to long-term memory", run_id)
