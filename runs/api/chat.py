"""`POST /api/chat/`: one chat turn, streamed as server-sent events.

An async view, so that under ASGI the turn runs on the server's event loop and Django notices
a client that goes away (it cancels the response, and the turn is aborted). Authentication
follows DRF's TokenAuthentication and SessionAuthentication (with its CSRF check) exactly; the
view is not a DRF view because DRF's views cannot stream from an async generator.

Stream: `event: run` (ids of the run, conversation and session), one `event: adk` per ADK event
(the event as JSON, camelCase), `event: done` (the settled run: status, error, result, tools). A
turn that waits for a decision on a call sends `event: waiting` (the calls) before `done` (status
`waiting`, with `waiting_for`); the conversation stays busy until the run has gone on.
Comment lines (`: keepalive`) keep idle connections open while a tool works. Refusals before
the stream are JSON `{"code", "detail", ...}` with 400, 401, 403, 404, 405, 409 or 413.
"""

from __future__ import annotations

import asyncio
import logging

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig, ValidationError
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions as drf_exceptions
from rest_framework.authentication import SessionAuthentication, TokenAuthentication, get_authorization_header

from config.lib import safe_json
from config.lib.api_errors import api_exception_handler
from config.lib.auth import ExpiringTokenAuthentication
from config.lib.refusals import Refusal
from config.lib.throttles import CHAT_TURN, throttle_wait
from runs.chat import turns as chat
from runs.models.approvals import PendingCall
from runs.models.ledger import AgentRun, RunStatus

logger = logging.getLogger(__name__)

FIELDS = {"agent", "owner_id", "message", "conversation_id", "params"}


def error_response(exc: Exception) -> JsonResponse:
    """The API's one translation of an error (refusals, validation, DRF's own), for this non-DRF view."""
    response = api_exception_handler(exc, {})
    if response is None:
        raise exc
    json_response = JsonResponse(response.data, status=response.status_code)
    for header in ("WWW-Authenticate", "Allow", "Retry-After"):
        if header in response:
            json_response[header] = response[header]
    if response.status_code == 401 and "WWW-Authenticate" not in json_response:
        json_response["WWW-Authenticate"] = TokenAuthentication.keyword
    return json_response


async def authenticate(request: HttpRequest):
    """The user, as DRF's Token then Session authentication would find them; raises DRF's errors."""
    token_auth = ExpiringTokenAuthentication()
    header = get_authorization_header(request).split()
    if header and header[0].lower() == token_auth.keyword.lower().encode():
        user, _token = await sync_to_async(token_auth.authenticate)(request)
        return user
    user = await request.auser()
    if user is not None and user.is_authenticated and user.is_active:
        SessionAuthentication().enforce_csrf(request)
        return user
    raise drf_exceptions.NotAuthenticated()


def _parse(request: HttpRequest) -> dict:
    try:
        body = safe_json.loads(request.body or b"")
    except safe_json.UnsafeInput as exc:
        raise ValidationError(
            {"body": f"The body must be a JSON object (Content-Type: application/json). {exc}"}
        ) from None
    if not isinstance(body, dict):
        raise ValidationError({"body": "The body must be a JSON object."})
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ValidationError({"body": f"Unknown field(s): {', '.join(unknown)}. Expected: {', '.join(sorted(FIELDS))}."})
    return body


class ChatStream(StreamingHttpResponse):
    """The streamed turn. Django closes every response it started, even one whose body never
    began because the client left first: that is the last chance to abandon the turn."""

    def __init__(self, turn: chat.ChatTurn):
        self.turn = turn
        super().__init__(self._frames(), content_type="text/event-stream; charset=utf-8")
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"  # nginx would otherwise buffer the stream
        self["X-Run-Id"] = str(turn.run.run_id)
        self["X-Conversation-Id"] = turn.run.conversation_id

    def close(self) -> None:
        self.turn.abandon()
        super().close()

    async def _frames(self):
        turn = self.turn
        run = turn.run
        try:
            yield chat.sse(
                "run",
                {
                    "run_id": str(run.run_id),
                    "conversation_id": run.conversation_id,
                    "session_id": run.session_id,
                    "status": "running",
                },
            )
            while True:
                try:
                    item = await asyncio.wait_for(turn.events.get(), settings.CHAT_KEEPALIVE_SECONDS)
                except TimeoutError:
                    yield b": keepalive\n\n"
                    continue
                if item is chat.END:
                    break
                yield chat.sse("adk", item, event_id=item.get("id"))
            if turn.task is not None:
                await asyncio.wait({turn.task})  # it settles the run before it ends
                if not turn.task.cancelled() and turn.task.exception() is not None:
                    logger.error("Chat run %s failed to execute", run.run_id, exc_info=turn.task.exception())
            settled = await AgentRun.objects.aget(pk=run.run_id)
            payload = chat.outcome_payload(settled)
            if settled.status == RunStatus.WAITING:
                # The turn waits for a decision: it leaves the stream, and the conversation stays busy
                # until the calls are answered and the run has gone on (runs.ledger.approvals).
                waiting_for = [
                    {"call_id": call.call_id, "kind": call.kind, "tool_name": call.tool_name, "args": call.args,
                     "hint": call.hint}
                    async for call in PendingCall.objects.filter(run_id=run.run_id, decision="").order_by("asked_at")
                ]
                payload["waiting_for"] = waiting_for
                yield chat.sse("waiting", {"run_id": str(run.run_id), "waiting_for": waiting_for})
            yield chat.sse("done", payload)
        finally:
            # Cancelled (the client left) or closed early: never leave the turn running unseen.
            turn.abandon()


@csrf_exempt  # CSRF is enforced for session-authenticated requests only, as DRF does
async def chat_turn(request: HttpRequest):
    if request.method != "POST":
        refused = error_response(drf_exceptions.MethodNotAllowed(request.method))
        refused["Allow"] = "POST"  # a 405 names what the resource does allow (RFC 9110)
        return refused
    try:
        user = await authenticate(request)
        wait = await sync_to_async(throttle_wait)(scope=CHAT_TURN, request=request, user=user)
        if wait is not None:
            raise drf_exceptions.Throttled(wait=wait, detail="Too many chat turns.")
        body = _parse(request)
    except (drf_exceptions.APIException, ValidationError, RequestDataTooBig) as exc:
        return error_response(exc)

    starting = asyncio.ensure_future(
        sync_to_async(chat.begin_turn)(
            user=user,
            agent_name=body.get("agent"),
            owner_id=body.get("owner_id"),
            message=body.get("message"),
            conversation_id=body.get("conversation_id"),
            params=body.get("params"),
        )
    )
    try:
        # Shielded: if the client leaves while the run is being written, the write still ends,
        # and the run it wrote is then settled as cancelled instead of waiting forever.
        run = await asyncio.shield(starting)
    except asyncio.CancelledError:
        starting.add_done_callback(_settle_if_written)
        raise
    except (ValidationError, Refusal) as exc:
        return error_response(exc)

    turn = chat.ChatTurn(run)
    turn.start()
    return ChatStream(turn)


def add_chat_to_schema(result: dict, generator, request, public) -> dict:
    """drf-spectacular postprocessing hook: the chat turn, which is not a DRF view, in the schema."""
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    described = {
        400: "Bad input (agent, owner_id, message, conversation_id, params).",
        401: "No or bad credentials.",
        403: "Not allowed (e.g. a session without its CSRF token).",
        404: "No such conversation, or not one you can see.",
        405: "Only POST.",
        409: "The conversation has a turn in flight.",
        413: "The request body is too large.",
        429: "Too many chat turns, or too many streams open; see Retry-After.",
    }
    text = {"type": "string", "minLength": 1}
    result["components"]["schemas"]["ChatTurnRequest"] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["agent", "owner_id", "message"],
        "properties": {
            "agent": {**text, "description": "A registered agent or a workflow's name."},
            "owner_id": {**text, "description": "The end user the conversation is with."},
            "message": {**text, "description": "What the user says."},
            "conversation_id": {"type": "string", "format": "uuid", "description": "Continue this conversation."},
            "params": {"type": "object", "description": "Run parameters, as for POST /api/runs/."},
        },
    }
    result["paths"]["/api/chat/"] = {
        "post": {
            "operationId": "chat_turn",
            "summary": "One chat turn, streamed as server-sent events",
            "description": "`event: run` (the run, conversation and session ids), one `event: adk` per ADK event "
                           "(JSON), then `event: done` (the settled run; a turn that waits for a decision sends `event: waiting` "
                           "first, and `done` says `waiting`). `: keepalive` comments keep an idle "
                           "stream open. Refusals before the stream are JSON errors.",
            "tags": ["chat"],
            "requestBody": {"required": True, "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ChatTurnRequest"}}
            }},
            "security": [{"tokenAuth": []}, {"cookieAuth": []}],
            "responses": {
                "200": {
                    "description": "The turn's events, as they happen.",
                    "headers": {
                        "X-Run-Id": {"schema": {"type": "string", "format": "uuid"}, "description": "The turn's run."},
                        "X-Conversation-Id": {"schema": {"type": "string"}, "description": "Its conversation."},
                    },
                    "content": {"text/event-stream": {"schema": {"type": "string"}}},
                },
                **{str(status): {"description": description, "content": error} for status, description in described.items()},
            },
        }
    }
    return result


def _settle_if_written(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        chat.start_abandoned(future.result())
