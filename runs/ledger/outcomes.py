"""What a run's execution came to: the outcome recorded on the run, said for people.

`runs.execution.executor` runs the agent and hands over what it saw (`RunEvents`: the final texts, the last
error event, the stored events), the exception that ended it, or the reason it was aborted; this
module turns each into the one `Outcome` the run is settled with (`lifecycle.settle_run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psycopg
from django.conf import settings
from google.adk.events.event import Event
from google.genai import errors as genai_errors

from agents.retrying import EMPTY_TURN, RATE_LIMIT, RetryLog, is_rate_limit
from agents.scripted import ScriptedModelError
from agents.workflows import StepEndedWithError, original_error
from runs.ledger import approvals
from runs.ledger.effects import effect_in_doubt_of
from runs.ledger.journal import JournalPlugin, duplicate_call_of
from runs.ledger.steps import RunStepRecorder, output_text
from runs.models.ledger import RunStatus


@dataclass
class Outcome:
    status: str
    error_code: str = ""
    error_message: str = ""
    result: str = ""
    # The run's stored events as ADK yielded them: what a successful run adds to memory,
    # without reading the session back.
    events: list[Event] = field(default_factory=list)
    # The calls a `waiting` outcome waits for (runs.ledger.approvals).
    waits: list[approvals.Wait] = field(default_factory=list)


def final_text(event: Event) -> str:
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


DATABASE_LOST = "database_lost"


def database_lost_of(exc: BaseException | None) -> BaseException | None:
    """The lost database connection behind an error (ADK's plugins and SQLAlchemy wrap it), if any.

    PostgreSQL's driver says so with an error of the connection class (08…), an operator's or a
    shutdown's intervention (57P…: pg_terminate_backend, a restart), or an error raised by the
    client itself with no state ("server closed the connection unexpectedly"); a statement's own
    failure (a timeout, a lock not available) is not one.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, psycopg.InterfaceError) or (
            isinstance(exc, psycopg.OperationalError) and _connection_state(getattr(exc, "sqlstate", None))
        ):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _connection_state(sqlstate: str | None) -> bool:
    return sqlstate is None or sqlstate.startswith(("08", "57P"))


def database_lost_message(exc: BaseException) -> str:
    return (
        "The worker lost its connection to the database while the run was in flight "
        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}): the run did not fail on "
        "its own. What it did before is in its journal."
    )


def describe_exception(exc: BaseException, plugin: JournalPlugin, retries: RetryLog | None = None) -> Outcome:
    in_doubt = effect_in_doubt_of(exc)
    if in_doubt is not None:
        return Outcome(RunStatus.ERROR, "effect_in_doubt", str(in_doubt))
    duplicate = duplicate_call_of(exc)
    if duplicate is not None:
        return Outcome(RunStatus.ERROR, "duplicate_call_id", str(duplicate))
    # A fault delivered by a plugin reaches here wrapped by ADK's plugin manager.
    tool_error = next((e for e in plugin.tool_errors.values() if e is exc or e is exc.__cause__), None)
    if tool_error is not None:
        return Outcome(RunStatus.ERROR, "tool_failed", f"A tool failed: {type(tool_error).__name__}: {tool_error}")
    if is_rate_limit(exc):
        return Outcome(RunStatus.ERROR, "rate_limited", rate_limit_message(exc, retries))
    if isinstance(exc, genai_errors.APIError | ScriptedModelError):
        return Outcome(RunStatus.ERROR, "model_error", f"The model call failed: {exc}")
    lost = database_lost_of(exc)
    if lost is not None:
        return Outcome(RunStatus.ERROR, DATABASE_LOST, database_lost_message(lost))
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
NO_ANSWER_MESSAGE = (
    "The agent finished without an answer: no final response came back and no error was reported. "
    "Check the run's events for its last model call before running it again."
)


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


# Why a run was aborted (`RunControl.abort`): the heartbeat's cancel request and time limit
# (`runs.execution.heartbeat` says these two), a chat client gone, the worker's drain.
CANCEL_REQUESTED = "cancel_requested"
TIMEOUT = "timeout"
CLIENT_DISCONNECTED = "client_disconnected"
WORKER_SHUTDOWN = "worker_shutdown"
# A workflow step's agent asked for a confirmation (or left a long-running call unanswered): a
# workflow cannot wait durably yet, so the run stops there rather than going on without the answer.
WORKFLOW_CANNOT_WAIT = "workflow_cannot_wait"


def workflow_cannot_wait_message(tools: list[str]) -> str:
    named = ", ".join(dict.fromkeys(tools)) or "a tool"
    return (
        f"A step of this workflow asked to wait ({named}: a person's approval or a long-running call's result). "
        "Workflow runs cannot wait yet, so the run was stopped at that step and the call never ran; run the agent "
        "that asks on its own (it waits durably there), or take the approval out of the workflow."
    )

INTERNAL_OUTCOME = Outcome(RunStatus.ERROR, "internal", "The worker stopped before the run finished.")


def worker_shutdown_message() -> str:
    return (
        f"The worker was stopped before the run finished: it had RUN_DRAIN_SECONDS="
        f"{settings.RUN_DRAIN_SECONDS:g} s to finish, then it was aborted. Check what it called "
        "before running it again."
    )


def aborted(reason: str) -> Outcome | None:
    """The outcome of a run aborted for `reason`; None for a reason this module does not know."""
    if reason == CANCEL_REQUESTED:
        return Outcome(RunStatus.CANCELLED, "cancelled", "The run was cancelled on request.")
    if reason == CLIENT_DISCONNECTED:
        return Outcome(
            RunStatus.CANCELLED, CLIENT_DISCONNECTED, "The chat client disconnected, so the run was cancelled."
        )
    if reason == WORKER_SHUTDOWN:
        return Outcome(RunStatus.ERROR, WORKER_SHUTDOWN, worker_shutdown_message())
    if reason == WORKFLOW_CANNOT_WAIT:
        return Outcome(RunStatus.ERROR, WORKFLOW_CANNOT_WAIT, workflow_cannot_wait_message([]))
    if reason == TIMEOUT:
        return Outcome(
            RunStatus.ERROR,
            "timeout",
            f"The run exceeded its time limit of {settings.RUN_TIMEOUT_SECONDS} s (RUN_TIMEOUT_SECONDS) and was stopped.",
        )
    return None


@dataclass
class RunEvents:
    """What a run's events said, gathered as ADK yields them."""

    texts: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    last_error: tuple[str, str] | None = None
    answered: bool = False  # a final response with content: text, or a tool's own answer (skip_summarization)

    def stored(self, event: Event) -> None:
        """Note a complete (not partial) event the runner yielded."""
        self.events.append(event)
        if event.error_code:
            self.last_error = (event.error_code, event.error_message or "")
        if event.author != "user" and event.is_final_response():
            self.answered = self.answered or bool(event.content and event.content.parts)
            text = final_text(event)
            if text:
                self.texts.append(text)


def finished(seen: RunEvents, *, steps: RunStepRecorder | None, retries: RetryLog) -> Outcome:
    """The outcome of a run whose events ended without an exception or an abort."""
    # A workflow's steps turn their own error events into failures (`describe_step_failure`); an
    # error event of an attempt that was retried afterwards is not the run's outcome.
    if seen.last_error is not None and steps is None:
        code, message = seen.last_error
        if code == "MODEL_RETURNED_NO_CONTENT":
            return Outcome(RunStatus.ERROR, "empty_turn", empty_turn_message(retries))
        if code != "INVOCATION_ABORTED":
            return Outcome(RunStatus.ERROR, code.lower()[:64], message or code)
    if steps is not None:
        waits = approvals.waits_in(seen.events)
        if waits:
            # A long-running call a step left unanswered (a confirmation request stops the run at once).
            return Outcome(RunStatus.ERROR, WORKFLOW_CANNOT_WAIT,
                           workflow_cannot_wait_message([wait.tool_name for wait in waits]))
        return Outcome(RunStatus.SUCCESS, result=output_text(steps.final_output), events=seen.events)
    waits = approvals.waits_in(seen.events)
    if waits:
        # Not an answer yet: the run waits for a person's decision or a long-running call's result.
        return Outcome(RunStatus.WAITING, result="\n".join(seen.texts), waits=waits)
    if not seen.texts and not seen.answered:
        # Whatever the model did, nothing answered the run: that is not a success to report.
        return Outcome(RunStatus.ERROR, "no_answer", NO_ANSWER_MESSAGE)
    return Outcome(RunStatus.SUCCESS, result="\n".join(seen.texts), events=seen.events)
