"""What a request on ADK's wires may do: sessions under the owner rule, a turn as a ledger run, an
answer to a waiting call as a decision (docs/architecture.md, "ADK's own wires").

Every function here is a door onto the ledger's own services: `runs.services.run.start_run` writes the
run (trigger `adk` or `a2a`), `runs.services.decisions.decide_call` / `give_result` take an answer, and the
owner rule and visibility are `runs.rules.permissions` / `runs.rules.visibility`. Nothing here appends to a
session: the only events a session gets from these wires are its runs'.
"""

from __future__ import annotations

import io
import mimetypes
import unicodedata
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from google.adk.utils._function_call_names import REQUEST_CONFIRMATION_FUNCTION_CALL_NAME
from google.genai import types

from agents import faults
from agents.models import AdkSession
from agents.registry import UnknownAgentError, get_agent_spec
from config.lib.refusals import Refusal
from config.lib.user_params import scripts_refusal
from runs.inputs import run_input
from runs.models.approvals import Decision, PendingCall, WaitKind
from runs.models.ledger import UNSETTLED, AgentRun, RunStatus, Trigger
from runs.rules import permissions
from runs.services import decisions
from runs.services import run as services

MAX_SESSION_ID_CHARS = 128


class WireRefusal(Refusal):
    """A request ADK's wire refuses before anything is written."""

    status = 400
    code = "bad_request"


class AppNotFound(WireRefusal):
    status = 404
    code = "not_found"


class SessionNotFound(WireRefusal):
    """No such session, or one of an owner the caller may not act for (said the same way on purpose)."""

    status = 404
    code = "not_found"

    def __init__(self, session_id: str):
        super().__init__(f"Session not found: {session_id}")


class SessionBusy(WireRefusal):
    status = 409
    code = "session_busy"


class SessionExists(WireRefusal):
    status = 409
    code = "already_exists"


class SessionHoldsEvidence(WireRefusal):
    status = 409
    code = "session_holds_evidence"


class NothingWaits(WireRefusal):
    status = 409
    code = "nothing_waits"


# --- Apps and owners --------------------------------------------------------------------------------


def check_app(app_name: Any) -> str:
    """The agent an ADK `app_name` names, else 404 naming the agents there are."""
    if not isinstance(app_name, str) or not app_name:
        raise WireRefusal("app_name is required: the name of an agent the ledger serves (GET /adk/list-apps).")
    try:
        return get_agent_spec(app_name).name
    except UnknownAgentError as exc:
        raise AppNotFound(str(exc)) from None


def check_owner(*, actor: Any, app_name: str, user_id: Any, session_id: str = "") -> str:
    """ADK's `user_id` is the run's owner: a caller who may not act for it sees none of its sessions (404)."""
    try:
        owner_id = run_input.clean_owner_id(user_id)
    except ValidationError as exc:
        raise WireRefusal(f"user_id: {' '.join(exc.message_dict['owner_id'])}") from None
    if not permissions.may_act_for_owner(user=actor, owner_id=owner_id):
        if session_id:
            raise SessionNotFound(session_id)
        raise SessionNotFound(f"no sessions of user {owner_id!r} of app {app_name!r} are visible to you")
    return owner_id


def clean_session_id(session_id: Any) -> str:
    if not isinstance(session_id, str) or not session_id.strip():
        raise WireRefusal("session_id is required: the id of a session (POST /adk/apps/{app}/users/{user}/sessions).")
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise WireRefusal(f"session_id is longer than {MAX_SESSION_ID_CHARS} characters.")
    if any(unicodedata.category(ch)[0] in "CZ" and ch != " " for ch in session_id) or session_id != session_id.strip():
        raise WireRefusal("session_id contains spaces at its ends, control or invisible characters.")
    return session_id


def session_exists(*, app_name: str, owner_id: str, session_id: str) -> bool:
    return AdkSession.objects.filter(app_name=app_name, user_id=owner_id, id=session_id).exists()


def check_new_session_id(session_id: str) -> None:
    """A session id the client picks must be new anywhere: the ledger keys sessions by id alone."""
    if AdkSession.objects.filter(id=session_id).exists():
        raise SessionExists(f"Session already exists: {session_id}")


def check_deletable(*, app_name: str, owner_id: str, session_id: str) -> None:
    """A session that holds a run's evidence stays: its events are what the desk, replays and resumes read."""
    run_ids = list(
        AgentRun.objects.filter(agent_name=app_name, owner_id=owner_id, session_id=session_id)
        .order_by("created_at").values_list("run_id", flat=True)[:5]
    )
    if run_ids:
        named = ", ".join(str(run_id) for run_id in run_ids)
        raise SessionHoldsEvidence(
            f"Session {session_id} holds the evidence of run(s) {named}: the ledger keeps it (the retention "
            "purge removes old events, EVENTS_RETENTION_DAYS). Start a new session instead."
        )


# --- A new message ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """A function response in a new message that answers a call the session's run waits for."""

    pending: PendingCall
    response: types.FunctionResponse


def message_text(message: types.Content | None) -> str:
    """A turn's input: the text of the new message (the ledger's runs take text, as POST /api/runs/ does)."""
    if message is None or not message.parts:
        raise WireRefusal("new_message is required: the user's message, with at least one text part.")
    texts: list[str] = []
    for index, part in enumerate(message.parts):
        if part.text is not None and not part.thought:
            texts.append(part.text)
        elif part.function_response is None and part.inline_data is None:
            raise WireRefusal(
                f"new_message.parts[{index}] is neither text, inline data nor a function response: the ledger's "
                "runs take text and one file."
            )
    return "\n".join(texts)


def message_file(message: types.Content | None) -> tuple[bytes, str] | None:
    """The one file (`inlineData`) a message may carry: the run's input file, copied like an upload."""
    blobs = [part.inline_data for part in (message.parts or []) if part.inline_data] if message else []
    if not blobs:
        return None
    if len(blobs) > 1:
        raise WireRefusal("new_message carries more than one inlineData part: a run takes one input file.")
    blob = blobs[0]
    name = blob.display_name or "input" + (mimetypes.guess_extension(blob.mime_type or "") or "")
    return blob.data or b"", name


def function_responses(message: types.Content | None) -> list[types.FunctionResponse]:
    return [part.function_response for part in (message.parts or []) if part.function_response] if message else []


def waiting_run(*, app_name: str, owner_id: str, session_id: str, lock: bool = False) -> AgentRun | None:
    runs = AgentRun.objects.filter(
        agent_name=app_name, owner_id=owner_id, session_id=session_id, status=RunStatus.WAITING
    )
    if lock:
        runs = runs.select_for_update()
    return runs.order_by("-created_at").first()


def _busy_run(*, app_name: str, owner_id: str, session_id: str) -> AgentRun | None:
    return (
        AgentRun.objects.filter(agent_name=app_name, owner_id=owner_id, session_id=session_id, status__in=UNSETTLED)
        .order_by("-created_at").first()
    )


def begin_turn(
    *,
    actor: Any,
    app_name: str,
    owner_id: str,
    session_id: str,
    message: types.Content | None,
    params: dict | None,
    trigger: str = Trigger.ADK,
    enqueue: bool = False,
) -> AgentRun:
    """Write one turn in an existing session as a queued run (executed by the caller when `enqueue` is False).

    The session is locked while the turn is written, so two turns sent at once are serialised and
    the second sees the first one busy.
    """
    text = message_text(message)
    refused = scripts_refusal(params) or (None if enqueue else faults.refused_in_web_process(params))
    if refused:
        raise WireRefusal(f"custom_metadata.params: {refused}")
    with transaction.atomic():
        session = AdkSession.objects.select_for_update().filter(
            app_name=app_name, user_id=owner_id, id=session_id
        ).first()
        if session is None:
            raise SessionNotFound(session_id)
        busy = _busy_run(app_name=app_name, owner_id=owner_id, session_id=session_id)
        if busy is not None:
            if busy.status == RunStatus.WAITING:
                raise SessionBusy(
                    f"Session {session_id} waits for an answer to run {busy.run_id}'s call(s) "
                    f"{', '.join(_open_calls(busy))}: answer each with a function response (for "
                    f"{REQUEST_CONFIRMATION_FUNCTION_CALL_NAME}, or for the long-running call) before a new message.",
                    run_id=str(busy.run_id),
                )
            raise SessionBusy(
                f"Session {session_id} is still answering an earlier message (run {busy.run_id}); "
                "wait for it to finish or cancel it.",
                run_id=str(busy.run_id),
            )
        attached = message_file(message)
        try:
            return services.start_run(
                agent_name=app_name, message=text, owner_id=owner_id, params=params, created_by=actor,
                trigger=trigger, session_id=session_id, enqueue=enqueue,
                file=io.BytesIO(attached[0]) if attached else None, file_name=attached[1] if attached else None,
            )
        except ValidationError as exc:
            raise WireRefusal(_said(exc)) from None


def _open_calls(run: AgentRun) -> list[str]:
    return [
        f"{call.tool_name} ({call.request_call_id or call.call_id})"
        for call in PendingCall.objects.filter(run_id=run.run_id, decision="").order_by("asked_at")
    ]


def _said(exc: ValidationError) -> str:
    return " ".join(f"{field}: {' '.join(messages)}" for field, messages in exc.message_dict.items())


def match_answers(*, run: AgentRun, responses: list[types.FunctionResponse]) -> list[Answer]:
    """Bind each function response to the call of `run` it answers: a confirmation by the id of its
    `adk_request_confirmation` call, a long-running call by its own id. Anything else is refused."""
    answers: list[Answer] = []
    calls = {call.request_call_id or call.call_id: call for call in PendingCall.objects.filter(run_id=run.run_id)}
    for response in responses:
        pending = calls.get(response.id or "")
        if pending is None:
            raise NothingWaits(
                f"Run {run.run_id} waits for no call {response.id!r}: answer "
                f"{', '.join(_open_calls(run)) or 'nothing (it waits for no call)'}.",
                run_id=str(run.run_id),
            )
        expected = REQUEST_CONFIRMATION_FUNCTION_CALL_NAME if pending.kind == WaitKind.CONFIRMATION else pending.tool_name
        if response.name and response.name != expected:
            raise WireRefusal(
                f"The function response for call {response.id} is named {response.name!r}; that call is "
                f"answered by a function response named {expected!r}."
            )
        answers.append(Answer(pending, response))
    return answers


def _confirmation(response: types.FunctionResponse) -> tuple[str, Any]:
    body = response.response or {}
    confirmed = body.get("confirmed")
    if not isinstance(confirmed, bool):
        raise WireRefusal(
            f"The answer to {REQUEST_CONFIRMATION_FUNCTION_CALL_NAME} {response.id} is a ToolConfirmation: "
            '{"confirmed": true} to approve, {"confirmed": false} to reject (a payload where the tool asks for one).'
        )
    return (Decision.APPROVE if confirmed else Decision.REJECT), (body.get("payload") if confirmed else None)


def answer_waiting(*, actor: Any, run: AgentRun, responses: list[types.FunctionResponse]) -> list[PendingCall]:
    """Take each answer through the decision API's own services: bound to its call, used once, permission checked.

    All answers of one message land together or none does. The run continues once it waits for
    nothing more (queued again, as after a decision from the desk).
    """
    answers = match_answers(run=run, responses=responses)
    taken: list[PendingCall] = []
    with transaction.atomic():
        for answer in answers:
            if answer.pending.kind == WaitKind.CONFIRMATION:
                decision, payload = _confirmation(answer.response)
                taken.append(decisions.decide_call(
                    run_id=run.run_id, call_id=answer.pending.call_id, actor=actor, decision=decision,
                    note="Answered over ADK's wire.", payload=payload,
                ))
            else:
                taken.append(decisions.give_result(
                    run_id=run.run_id, call_id=answer.pending.call_id, actor=actor,
                    result=answer.response.response, note="Answered over ADK's wire.",
                ))
    return taken
