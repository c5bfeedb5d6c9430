"""Executing one claimed run: the ADK runner, the heartbeat, and the outcome.

The agent runs on the process's long-lived agent loop (`agents.adk`). The process's one
heartbeat (`runs.heartbeat`, a plain thread) keeps every run it holds alive and carries
cancellation and each run's time limit back into the loop as ADK's abort signal, which seals
pending calls instead of leaving them dangling.

Three doors share one implementation: `drive()` for a run the worker's pool (`runs.worker`)
claimed and keeps in flight beside others, `execute()` for a caller that waits for its run
(`run_agent --inline`, tasks outside a cluster), and `aexecute()` for a chat turn streamed by the
ASGI server on its own loop. All claim, beat, run and settle in the same way.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from google.adk.agents.run_config import RunConfig
from google.adk.apps import App
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.events.event import Event
from google.adk.runners import Runner
from google.genai import errors as genai_errors
from google.genai import types

from agents.adk import drop_unusable_connection, refresh_orm_thread_connections, run_coroutine, session_service
from agents.registry import build_agent, build_app, get_agent_spec
from agents.retrying import EMPTY_TURN, RATE_LIMIT, RetryLog, current_retry_log, is_rate_limit
from agents.scripted import ScriptedModelError
from agents.workflows import StepEndedWithError, compile_workflow, original_error
from memory.adk import memory_service
from memory.services import remember_events
from runs import approvals, lifecycle, telemetry
from runs.counters import MODEL_RETRIES
from runs.effects import EffectsPlugin, effect_in_doubt_of
from runs.heartbeat import process_heartbeat
from runs.journal import JournalPlugin, duplicate_call_of
from runs.models import AgentRun, RunStatus
from runs.resume import ResumePlan, resume_plan
from runs.steps import RunStepRecorder, output_text

logger = logging.getLogger(__name__)


@dataclass
class Outcome:
    status: str
    error_code: str = ""
    error_message: str = ""
    result: str = ""
    # The run's stored events as ADK yielded them: what a successful run adds to memory,
    # without reading the session back.
    events: list[Event] = field(default_factory=list)
    # The calls a `waiting` outcome waits for (runs.approvals).
    waits: list[approvals.Wait] = field(default_factory=list)


class RunControl:
    """One run in flight in this process, and its way to abort the run's ADK invocation.

    The process's one heartbeat (`runs.heartbeat`) keeps it alive and aborts it on a cancel
    request or past its time limit; the worker's drain aborts it on shutdown.
    """

    def __init__(self, run_id: uuid.UUID):
        self.run_id = run_id
        self.run: AgentRun | None = None  # the claimed row, as it was when claimed
        self.abort_reason: str | None = None
        self.cancelled_by_request = False
        self.started_monotonic = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abort_event: asyncio.Event | None = None

    def start(self) -> None:
        self.started_monotonic = time.monotonic()
        process_heartbeat().add(self)

    def stop(self) -> None:
        process_heartbeat().remove(self)

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


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def rate_limit_message(exc: genai_errors.ClientError, retries: RetryLog | None) -> str:
    said = f"The model provider rate-limited the run (429 {exc.status or 'RESOURCE_EXHAUSTED'})"
    gave_up = retries.gave_up if retries is not None else None
    if not gave_up or gave_up.get("reason") != RATE_LIMIT:
        return f"{said} in the middle of an answer, which cannot be retried safely."
    count = gave_up["retries"]
    if gave_up.get("over_max_wait"):
        return (
            f"{said}; the model call was retried {_plural(count, 'time')}, then the provider's "
            f"next wait of {gave_up['next_delay_s']:g} s would have passed "
            f"MODEL_RETRY_MAX_WAIT_SECONDS={settings.MODEL_RETRY_MAX_WAIT_SECONDS:g}, so it gave up."
        )
    return (
        f"{said} and was still rate limited after the model call was retried "
        f"{_plural(count, 'time')} over {gave_up['waited_s']:g} s "
        f"(MODEL_RATE_LIMIT_RETRIES={settings.MODEL_RATE_LIMIT_RETRIES})."
    )


def describe_exception(exc: BaseException, plugin: JournalPlugin, retries: RetryLog | None = None) -> Outcome:
    in_doubt = effect_in_doubt_of(exc)
    if in_doubt is not None:
        return Outcome(RunStatus.ERROR, "effect_in_doubt", str(in_doubt))
    duplicate = duplicate_call_of(exc)
    if duplicate is not None:
        return Outcome(RunStatus.ERROR, "duplicate_call_id", str(duplicate))
    tool_error = next((e for e in plugin.tool_errors.values() if e is exc), None)
    if tool_error is not None:
        return Outcome(RunStatus.ERROR, "tool_failed", f"A tool failed: {type(exc).__name__}: {exc}")
    if is_rate_limit(exc):
        return Outcome(RunStatus.ERROR, "rate_limited", rate_limit_message(exc, retries))
    if isinstance(exc, genai_errors.APIError | ScriptedModelError):
        return Outcome(RunStatus.ERROR, "model_error", f"The model call failed: {exc}")
    return Outcome(RunStatus.ERROR, "agent_error", f"{type(exc).__name__}: {exc}")


def describe_step_failure(
    exc: BaseException, steps: RunStepRecorder, plugin: JournalPlugin, retries: RetryLog | None = None
) -> Outcome:
    """A workflow's failure, said as its first failing step's (a retried step's own error, unwrapped)."""
    error = original_error(exc)
    if isinstance(error, StepEndedWithError) and error.code == "MODEL_RETURNED_NO_CONTENT":
        outcome = Outcome(RunStatus.ERROR, "empty_turn", empty_turn_message(retries) if retries else EMPTY_TURN_MESSAGE)
    elif isinstance(error, StepEndedWithError):
        outcome = Outcome(RunStatus.ERROR, error.code.lower()[:64], error.message or error.code)
    else:
        outcome = describe_exception(error, plugin, retries)
    if steps.first_failure is not None:
        node_path, _error = steps.first_failure
        step = node_path.rsplit("/", 1)[-1].split("@", 1)[0]
        outcome.error_message = f"Step “{step}” ({node_path}) failed. {outcome.error_message}"
    return outcome


EMPTY_TURN_MESSAGE = "The model returned an empty answer, so the run stopped without a result."


def empty_turn_message(retries: RetryLog) -> str:
    gave_up = retries.gave_up or {}
    count = gave_up.get("retries", 0) if gave_up.get("reason") == EMPTY_TURN else 0
    if not count:
        return EMPTY_TURN_MESSAGE
    return (
        f"The model returned an empty answer {count + 1} times in a row (it was asked again "
        f"{_plural(count, 'time')}, EMPTY_TURN_RETRIES={settings.EMPTY_TURN_RETRIES}), so the run "
        "stopped without a result."
    )


CLIENT_DISCONNECTED = "client_disconnected"
WORKER_SHUTDOWN = "worker_shutdown"


def worker_shutdown_message() -> str:
    return (
        f"The worker was stopped before the run finished: it had RUN_DRAIN_SECONDS="
        f"{settings.RUN_DRAIN_SECONDS:g} s to finish, then it was aborted. Check what it called "
        "before running it again."
    )


def retry_log_for(run: AgentRun) -> RetryLog:
    async def store(entries: list[dict]) -> None:
        MODEL_RETRIES.labels(reason=entries[-1]["reason"]).inc()  # called once per retry
        await AgentRun.objects.filter(pk=run.run_id).aupdate(model_retries=entries)

    return RetryLog(on_change=store)


async def run_agent(
    run: AgentRun, control: RunControl, *, on_event: Callable[[Event], None] | None = None
) -> Outcome:
    """Run the agent for `run` and return its outcome; `on_event` sees every event ADK yields."""
    plugin = JournalPlugin(run.run_id)
    # Journal first, then effects: the effect class is stamped on the event the journal records.
    plugins = [plugin, EffectsPlugin(run)]
    retries = retry_log_for(run)
    steps = RunStepRecorder(run.run_id) if run.workflow else None
    # A resumed run continues its original's session: no new user message, an answer for each
    # dangling call instead, and its scripted models where the original's stopped.
    # A run claimed again after it waited goes on with the answers it waited for (runs.approvals);
    # a resume answers its original's dangling calls on its first attempt only.
    going_on = await sync_to_async(approvals.continuation)(run) if run.attempts > 1 else None
    first_resume = run.resume_of_id and run.attempts <= 1
    plan: ResumePlan | None = await sync_to_async(resume_plan)(run) if first_resume else None
    if plan is not None and plan.final_text is not None:
        # Nothing was left unanswered and the agent had already answered: that answer is the result
        # (another model call would only say something else after it).
        return Outcome(RunStatus.SUCCESS, result=plan.final_text)
    if steps is not None:
        # A workflow run executes the graph it stored when it was written (its replays too).
        root = compile_workflow(run.workflow, params=run.params, recorder=steps)
        app = App(name=run.agent_name, root_agent=root, plugins=plugins)
    else:
        # The run's own wrapped copy of the loaded agent tree; the package's App keeps its plugins.
        spec = get_agent_spec(run.agent_name)
        positions = going_on.positions if going_on else plan.positions if plan else None
        root = build_agent(spec, params=run.params, positions=positions)
        app = build_app(spec, root=root, name=run.agent_name, plugins=plugins)
    # Set before ADK creates its tasks, which copy the context: every model call finds the log.
    log_token = current_retry_log.set(retries)
    sessions = session_service()
    try:
        # Most runs get a fresh session: create it without reading first.
        await sessions.create_session(app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id)
    except AlreadyExistsError:
        pass  # a conversation's session, created by its first turn
    if plan is not None and plan.responses is not None:
        await append_responses(run, plan)
    if going_on is not None:
        await sync_to_async(approvals.mark_delivered)(run=run, call_ids=going_on.call_ids)
        new_message = going_on.message
    else:
        new_message = None if plan is not None or run.attempts > 1 else user_content(run)
    runner = Runner(app=app, session_service=sessions, memory_service=memory_service())
    abort_event = asyncio.Event()
    control.attach(asyncio.get_running_loop(), abort_event)
    texts: list[str] = []
    events: list[Event] = []
    last_error: tuple[str, str] | None = None
    try:
        async for event in runner.run_async(
            user_id=run.owner_id,
            session_id=run.session_id,
            invocation_id=run.invocation_id,
            new_message=new_message,
            run_config=RunConfig(custom_metadata={"run_id": str(run.run_id)}),
            abort_signal=abort_event,
            yield_user_message=True,
        ):
            if not event.partial:
                events.append(event)
            if event.author == "user" and event.invocation_id == run.invocation_id and not event.get_function_responses():
                continue  # the run's own message, kept for memory; callers never asked to see it
            if on_event is not None:
                on_event(event)
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
            if steps is not None:
                return describe_step_failure(exc, steps, plugin, retries)
            return describe_exception(exc, plugin, retries)
    finally:
        current_retry_log.reset(log_token)
        await runner.close()

    if control.abort_reason == "cancel_requested":
        return Outcome(RunStatus.CANCELLED, "cancelled", "The run was cancelled on request.")
    if control.abort_reason == CLIENT_DISCONNECTED:
        return Outcome(
            RunStatus.CANCELLED, CLIENT_DISCONNECTED, "The chat client disconnected, so the run was cancelled."
        )
    if control.abort_reason == WORKER_SHUTDOWN:
        return Outcome(RunStatus.ERROR, WORKER_SHUTDOWN, worker_shutdown_message())
    if control.abort_reason == "timeout":
        return Outcome(
            RunStatus.ERROR,
            "timeout",
            f"The run exceeded its time limit of {settings.RUN_TIMEOUT_SECONDS} s (RUN_TIMEOUT_SECONDS) and was stopped.",
        )
    # A workflow's steps turn their own error events into failures (above); an error event of
    # an attempt that was retried afterwards is not the run's outcome.
    if last_error is not None and steps is None:
        code, message = last_error
        if code == "MODEL_RETURNED_NO_CONTENT":
            return Outcome(RunStatus.ERROR, "empty_turn", empty_turn_message(retries))
        if code != "INVOCATION_ABORTED":
            return Outcome(RunStatus.ERROR, code.lower()[:64], message or code)
    if steps is not None:
        return Outcome(RunStatus.SUCCESS, result=output_text(steps.final_output), events=events)
    waits = approvals.waits_in(events)
    if waits:
        return Outcome(RunStatus.WAITING, result="\n".join(texts), waits=waits)
    return Outcome(RunStatus.SUCCESS, result="\n".join(texts), events=events)


async def append_responses(run: AgentRun, plan: ResumePlan) -> None:
    """Store the answers to the dangling calls as the resumed run's first event, under its own invocation.

    Passed as `new_message`, ADK would resolve the invocation from the calls' ids
    (`Runner._resolve_invocation_id_from_fr`) and run under the original's invocation id instead
    of this run's; stored first, they pair with their calls in the model's history and the run
    keeps its own invocation (its journal, timeline and memory).
    """
    sessions = session_service()
    session = await sessions.get_session(app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id)
    await sessions.append_event(
        session,
        Event(invocation_id=run.invocation_id, author="user", content=plan.responses,
              custom_metadata={"run_id": str(run.run_id)}),
    )


INTERNAL_OUTCOME = Outcome(RunStatus.ERROR, "internal", "The worker stopped before the run finished.")


def begin(run_id: uuid.UUID, control: RunControl) -> bool:
    """Claim the run and start its heartbeat; False if it was no longer queued."""
    run = lifecycle.claim_and_load_run(run_id=run_id, worker=lifecycle.worker_name())
    if run is None:
        logger.info("Run %s was not claimed: it is no longer queued", run_id)
        return False
    control.run = run
    control.start()
    return True


def finish(run_id: uuid.UUID, control: RunControl, outcome: Outcome) -> None:
    control.stop()
    # One commit for the outcome and the memories it feeds; the memories sit in a savepoint, so
    # failing to remember can never undo the recorded outcome.
    if outcome.status == RunStatus.WAITING and control.run is not None:
        # Not settled: the run leaves its worker until its calls are answered (runs.approvals).
        approvals.park_run(run=control.run, waits=outcome.waits, result=outcome.result)
        return
    with transaction.atomic():
        settled = lifecycle.settle_run(
            run_id=run_id,
            status=outcome.status,
            error_code=outcome.error_code,
            error_message=outcome.error_message,
            result=outcome.result,
            run=control.run,
        )
        if settled and outcome.status == RunStatus.SUCCESS:
            _remember(run_id, control.run, outcome.events)


def _remember(run_id: uuid.UUID, run: AgentRun | None, events: list[Event]) -> None:
    try:
        with transaction.atomic():
            # A run that waited went on in later attempts: its conversation is read from the session.
            if run is not None and events and run.attempts <= 1:
                remember_events(
                    agent=run.agent_name, owner_id=run.owner_id, session_id=run.session_id,
                    invocation_id=run.invocation_id, run_id=run.run_id, events=events,
                )
                lifecycle.remember_predecessors(run)
            else:
                lifecycle.remember_run(run_id=run_id)
    except Exception:  # noqa: BLE001
        logger.exception("Run %s: its conversation could not be added to long-term memory", run_id)


async def run_claimed(
    run_id: uuid.UUID, control: RunControl, *, on_event: Callable[[Event], None] | None = None
) -> Outcome:
    try:
        run = control.run if control.run is not None else await AgentRun.objects.aget(pk=run_id)
        async with telemetry.run_scope(run) as scope:
            return scope.settled(await run_agent(run, control, on_event=on_event))
    except Exception as exc:  # noqa: BLE001
        logger.exception("Run %s: execution failed", run_id)
        return Outcome(RunStatus.ERROR, "internal", f"The worker could not run the agent: {type(exc).__name__}: {exc}")


def execute(run_id: uuid.UUID) -> str:
    """Claim and run one run; safe to call twice (the second call finds nothing to claim)."""
    control = RunControl(run_id)
    if not begin(run_id, control):
        return "not claimed"
    outcome = INTERNAL_OUTCOME
    try:
        refresh_orm_thread_connections()
        outcome = run_coroutine(run_claimed(run_id, control))
    finally:
        finish(run_id, control, outcome)
    return outcome.status


async def drive(
    run_id: uuid.UUID, control: RunControl, *, on_event: Callable[[Event], None] | None = None
) -> Outcome:
    """Run a claimed run on the running loop and settle it, whatever happens (the `finally`)."""
    outcome = INTERNAL_OUTCOME
    try:
        await sync_to_async(drop_unusable_connection)()
        outcome = await run_claimed(run_id, control, on_event=on_event)
    finally:
        await sync_to_async(finish)(run_id, control, outcome)
    return outcome


async def aexecute(
    run_id: uuid.UUID, control: RunControl, *, on_event: Callable[[Event], None] | None = None
) -> Outcome | None:
    """Claim and run one run on the running event loop; None if it was no longer queued.

    The caller keeps `control` to abort the run (e.g. when its client goes away).
    """
    if not await sync_to_async(begin)(run_id, control):
        return None
    return await drive(run_id, control, on_event=on_event)
