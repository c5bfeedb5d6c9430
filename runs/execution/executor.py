"""Executing one claimed run: the ADK runner, the heartbeat, and the outcome.

The agent runs on the process's long-lived agent loop (`agents.adk`). The process's one
heartbeat (`runs.execution.heartbeat`, a plain thread) keeps every run it holds alive and carries
cancellation and each run's time limit back into the loop as ADK's abort signal, which seals
pending calls instead of leaving them dangling.

Three doors share one implementation: `drive()` for a run a worker process (`runs.worker.processes`)
claimed from the ledger and keeps in flight beside others, `execute()` for a caller that waits
for its run (`run_agent --inline`, a webhook event's worker, the test suite), and `aexecute()` for a chat turn streamed by the
ASGI server on its own loop. All claim, beat, run and settle in the same way. What a run came to
(its `Outcome`, said for people) is `runs.ledger.outcomes`.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from asgiref.sync import sync_to_async
from django.db import transaction
from google.adk.agents.run_config import RunConfig
from google.adk.apps import App
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.events.event import Event
from google.adk.runners import Runner
from google.genai import types

from agents import faults, scripted
from agents.adk import drop_unusable_connection, refresh_orm_thread_connections, run_coroutine, session_service
from agents.registry import build_agent, build_app, get_agent_spec
from agents.retrying import RetryLog, current_retry_log
from agents.workflows import compile_workflow
from memory.adk import memory_service
from memory.services import remember_events
from runs.execution import telemetry
from runs.execution.heartbeat import process_heartbeat
from runs.ledger import approvals, leases, lifecycle, outcomes
from runs.ledger.counters import MODEL_RETRIES
from runs.ledger.effects import EffectsPlugin
from runs.ledger.journal import JournalPlugin
from runs.ledger.outcomes import Outcome
from runs.ledger.steps import RunStepRecorder
from runs.models.ledger import AgentRun, RunStatus
from runs.refusals import OwnerNotPermitted
from runs.rules import owners
from runs.rules.faults import faults_honoured
from runs.rules.resume import ResumePlan, resume_plan

logger = logging.getLogger(__name__)


class RunControl:
    """One run in flight in this process, and its way to abort the run's ADK invocation.

    The process's one heartbeat (`runs.execution.heartbeat`) keeps it alive and aborts it on a cancel
    request or past its time limit; the worker's drain aborts it on shutdown.
    """

    def __init__(self, run_id: uuid.UUID):
        self.run_id = run_id
        self.run: AgentRun | None = None  # the claimed row, as it was when claimed
        # Whether the run's scripted faults happen, worked out at the claim (no hop of its own).
        self.faults_honoured: bool | None = None
        self.abort_reason: str | None = None
        self.cancelled_by_request = False
        self.started_monotonic = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abort_event: asyncio.Event | None = None

    @property
    def lease(self) -> uuid.UUID | None:
        """The lease of the claim this control holds the run under (runs.ledger.leases)."""
        return self.run.lease if self.run is not None else None

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


def retry_log_for(run: AgentRun) -> RetryLog:
    async def store(entries: list[dict]) -> None:
        MODEL_RETRIES.labels(reason=entries[-1]["reason"]).inc()  # called once per retry
        if not await leases.held(run_id=run.run_id, lease=run.lease).aupdate(model_retries=entries):
            raise leases.refuse(run_id=run.run_id, what="the model retry log")

    return RetryLog(on_change=store)


def _build_app(
    run: AgentRun, *, positions: dict | None, plugins: list, steps: RunStepRecorder | None
) -> App:
    if steps is not None:
        # A workflow run executes the graph it stored when it was written (its replays too).
        root = compile_workflow(run.workflow, params=run.params, recorder=steps)
        return App(name=run.agent_name, root_agent=root, plugins=plugins)
    # The run's own wrapped copy of the loaded agent tree; the package's App keeps its plugins.
    spec = get_agent_spec(run.agent_name)
    # A replay or resume continues work its chain already tried: a transient scripted failure is spent.
    continued = run.replay_of_id is not None or run.resume_of_id is not None
    params = scripted.transient_failures_spent(run.params) if continued else run.params
    root = build_agent(spec, params=params, positions=positions)
    return build_app(spec, root=root, name=run.agent_name, plugins=plugins)


async def _prepare_session(run: AgentRun, plan: ResumePlan | None) -> None:
    sessions = session_service()
    try:
        # Most runs get a fresh session: create it without reading first.
        await sessions.create_session(app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id)
    except AlreadyExistsError:
        pass  # a conversation's session, created by its first turn
    if plan is not None and plan.responses is not None:
        await append_responses(run, plan)


async def _run_events(
    runner: Runner, run: AgentRun, *, new_message: types.Content | None, abort_event: asyncio.Event,
    on_event: Callable[[Event], None] | None, seen: outcomes.RunEvents,
    on_confirmation_request: Callable[[list[str]], None] | None = None,
) -> None:
    """Run the agent, noting what its events say in `seen` as they come (an exception keeps what came)."""
    async for event in runner.run_async(
        user_id=run.owner_id,
        session_id=run.session_id,
        invocation_id=run.invocation_id,
        new_message=new_message,
        run_config=RunConfig(custom_metadata=run_metadata(run)),
        abort_signal=abort_event,
        yield_user_message=True,
    ):
        own_message = (
            event.author == "user" and event.invocation_id == run.invocation_id and not event.get_function_responses()
        )
        # The run's own message is kept for memory; callers never asked to see it.
        if on_event is not None and not own_message:
            on_event(event)
        if not event.partial:
            seen.stored(event)
            if on_confirmation_request is not None and (asked := approvals.asks_confirmation(event)):
                on_confirmation_request(asked)


async def run_agent(
    run: AgentRun, control: RunControl, *, on_event: Callable[[Event], None] | None = None
) -> Outcome:
    """Run the agent for `run` and return its outcome; `on_event` sees every event ADK yields."""
    if owners.is_continuation(run) and not await sync_to_async(owners.may_continue)(run):
        # A grant taken back takes effect at once: a run going on without its person at a door
        # (answered after it waited, continued by the system) ends refused, before ADK writes anything.
        return Outcome(RunStatus.ERROR, OwnerNotPermitted.code, owners.no_longer_permitted(run))
    plugin = JournalPlugin(run.run_id, lease=run.lease)
    # Journal first, then effects: the effect class is stamped on the event the journal records.
    # Scripted tool faults sit either side of the effects plugin, at every tool's boundary.
    honoured = control.faults_honoured
    if honoured is None:
        honoured = await sync_to_async(faults_honoured)(run)
    plugins = [plugin, *faults.around_effects(EffectsPlugin(run), honoured=honoured)]
    retries = retry_log_for(run)
    steps = RunStepRecorder(run.run_id, lease=run.lease) if run.workflow else None
    # A resumed run continues its original's session: no new user message, an answer for each
    # dangling call instead, and its scripted models where the original's stopped.
    # A run claimed again after it waited goes on with the answers it waited for (runs.ledger.approvals);
    # a resume answers its original's dangling calls on its first attempt only.
    going_on = await sync_to_async(approvals.continuation)(run) if run.attempts > 1 else None
    first_resume = run.resume_of_id and run.attempts <= 1
    plan: ResumePlan | None = await sync_to_async(resume_plan)(run) if first_resume else None
    if plan is not None and plan.final_text is not None:
        # Nothing was left unanswered and the agent had already answered: that answer is the result
        # (another model call would only say something else after it).
        return Outcome(RunStatus.SUCCESS, result=plan.final_text)
    positions = going_on.positions if going_on else plan.positions if plan else None
    app = _build_app(run, positions=positions, plugins=plugins, steps=steps)
    # Set before ADK creates its tasks, which copy the context: every model call finds the log.
    log_token = current_retry_log.set(retries)
    await _prepare_session(run, plan)
    if going_on is not None:
        await sync_to_async(approvals.mark_delivered)(run=run, call_ids=going_on.call_ids)
        new_message = going_on.message
    else:
        new_message = None if plan is not None or run.attempts > 1 else user_content(run)
    runner = Runner(app=app, session_service=session_service(), memory_service=memory_service())
    abort_event = asyncio.Event()
    control.attach(asyncio.get_running_loop(), abort_event)
    seen = outcomes.RunEvents()
    asked_in_workflow: list[str] = []

    def workflow_cannot_wait(tools: list[str]) -> None:
        # Stop before a later step runs on the step's unanswered output (docs/runs.md, "Approvals and tools that wait").
        asked_in_workflow.extend(tools)
        control.abort(outcomes.WORKFLOW_CANNOT_WAIT)

    try:
        await _run_events(
            runner, run, new_message=new_message, abort_event=abort_event, on_event=on_event, seen=seen,
            on_confirmation_request=workflow_cannot_wait if steps is not None else None,
        )
    except Exception as exc:  # noqa: BLE001 - every failure becomes the run's recorded outcome
        if leases.lease_lost_of(exc) is not None:
            control.abort(leases.LEASE_LOST)
        if control.abort_reason is None:
            logger.info("Run %s failed: %r", run.run_id, exc)
            if steps is not None:
                return outcomes.describe_step_failure(exc, steps, plugin, retries)
            return outcomes.describe_exception(exc, plugin, retries)
    finally:
        current_retry_log.reset(log_token)
        await runner.close()
    if control.abort_reason == leases.LEASE_LOST:
        return Outcome(RunStatus.ERROR, leases.LEASE_LOST, "The worker no longer held the run, so it stopped it.")
    if control.abort_reason == outcomes.WORKFLOW_CANNOT_WAIT:
        return Outcome(RunStatus.ERROR, outcomes.WORKFLOW_CANNOT_WAIT,
                       outcomes.workflow_cannot_wait_message(asked_in_workflow))
    if control.abort_reason is not None:
        aborted = outcomes.aborted(control.abort_reason)
        if aborted is not None:
            return aborted
    return outcomes.finished(seen, steps=steps, retries=retries)


def run_metadata(run: AgentRun) -> dict[str, str]:
    """Stamped on every event of the run's invocation: whose it is, and the lease it is written under."""
    metadata = {"run_id": str(run.run_id)}
    if run.lease is not None:
        metadata[leases.LEASE_METADATA_KEY] = str(run.lease)
    return metadata


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
              custom_metadata=run_metadata(run)),
    )


NOT_CLAIMED = "not claimed"


def begin(run_id: uuid.UUID, control: RunControl) -> bool:
    """Claim the run and start its heartbeat; False if it was no longer queued."""
    run = lifecycle.claim_and_load_run(run_id=run_id, worker=lifecycle.worker_name())
    if run is None:
        logger.info("Run %s was not claimed: it is no longer queued", run_id)
        return False
    adopt(run, control)
    return True


def adopt(run: AgentRun, control: RunControl) -> None:
    """Hold a run this process just claimed (`run`, the row as claimed): its heartbeat starts."""
    control.run = run
    control.faults_honoured = faults_honoured(run)
    control.start()


def finish(run_id: uuid.UUID, control: RunControl, outcome: Outcome) -> None:
    control.stop()
    if control.abort_reason == leases.LEASE_LOST:
        # The run is someone else's now (reconciled, maybe continued): nothing more is written.
        logger.warning("Run %s: stopped without settling it, its lease is gone", run_id)
        return
    if outcome.status == RunStatus.WAITING and control.run is not None:
        # Not settled: the run leaves its worker until its calls are answered (runs.ledger.approvals).
        approvals.park_run(run=control.run, waits=outcome.waits, result=outcome.result)
        return
    # One commit for the outcome and the memories it feeds; the memories sit in a savepoint, so
    # failing to remember can never undo the recorded outcome.
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
        return NOT_CLAIMED
    return run_adopted(run_id, control)


def run_adopted(run_id: uuid.UUID, control: RunControl) -> str:
    """Run a run this process holds (`begin` or `adopt`) to its end here; its status."""
    outcome = outcomes.INTERNAL_OUTCOME
    try:
        refresh_orm_thread_connections()
        outcome = run_coroutine(run_claimed(run_id, control))
    finally:
        finish(run_id, control, outcome)
    return outcome.status


async def drive(
    run_id: uuid.UUID, control: RunControl, *, on_event: Callable[[Event], None] | None = None,
    connection_checked: bool = False,
) -> Outcome:
    """Run a claimed run on the running loop and settle it, whatever happens (the `finally`).

    `connection_checked`: the caller already dropped a broken ORM-thread connection in its own hop.
    """
    outcome = outcomes.INTERNAL_OUTCOME
    try:
        if not connection_checked:
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
    def checked_and_begun() -> bool:
        # One hop to the ORM thread for both: its connection checked, then the claim on it.
        drop_unusable_connection()
        return begin(run_id, control)

    if not await sync_to_async(checked_and_begun)():
        return None
    return await drive(run_id, control, on_event=on_event, connection_checked=True)
