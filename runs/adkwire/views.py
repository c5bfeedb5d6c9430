"""ADK's API server routes under /adk/, for the agents the ledger serves (docs/architecture.md, "ADK's own wires").

Same paths, bodies (ADK's own `RunAgentRequest` and `CreateSessionRequest`: camelCase and
snake_case alike) and answers as `adk api_server`, with the ledger's authentication (API tokens,
or a desk session with its CSRF token) and the owner rule: ADK's `user_id` is the owner.
Errors are FastAPI's shape, `{"detail": …}` (422 with a list for a body that does not parse), plus
the ledger's `code`. Async views, so that under ASGI a turn runs on the server's loop and a
client that leaves is noticed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pydantic
import pydantic_core
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig, ValidationError
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from google.adk.auth.auth_credential import _redact_credential_secrets
from google.adk.cli.api_server import CreateSessionRequest, RunAgentRequest
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.events._internal_metadata import public_session
from rest_framework import exceptions as drf_exceptions

from agents.adk import session_service
from agents.registry import AGENTS, runnable_agents
from config.lib import safe_json
from config.lib.refusals import Refusal
from config.lib.throttles import CHAT_TURN, throttle_wait
from runs.adkwire import stream, turns
from runs.api.chat import authenticate
from runs.models.ledger import AgentRun

logger = logging.getLogger(__name__)


# --- Errors in ADK's shape ----------------------------------------------------------------------------


def detail(status: int, text: Any, *, code: str = "", headers: dict | None = None) -> JsonResponse:
    body = {"detail": text}
    if code:
        body["code"] = code
    response = JsonResponse(body, status=status, safe=False)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def error_response(exc: Exception) -> JsonResponse:
    if isinstance(exc, Refusal):
        return detail(exc.status, exc.detail, code=exc.code)
    if isinstance(exc, drf_exceptions.APIException):
        headers = {}
        if exc.status_code == 401:
            headers["WWW-Authenticate"] = "Token"
        if isinstance(exc, drf_exceptions.Throttled) and exc.wait:
            headers["Retry-After"] = str(int(exc.wait) + 1)
        codes = exc.get_codes()
        return detail(exc.status_code, str(exc.detail), code=codes if isinstance(codes, str) else "", headers=headers)
    if isinstance(exc, RequestDataTooBig):
        return detail(413, "The request body is too large.", code="too_large")
    if isinstance(exc, pydantic.ValidationError):
        # FastAPI's 422: the list of what did not validate, each with where and why.
        return detail(422, json.loads(exc.json(include_url=False, include_input=False)), code="invalid")
    if isinstance(exc, ValidationError):
        said = " ".join(f"{field}: {' '.join(messages)}" for field, messages in exc.message_dict.items())
        return detail(400, said, code="invalid")
    raise exc


def _body(request: HttpRequest, model: type[pydantic.BaseModel], *, optional: bool = False) -> Any:
    raw = request.body or b""
    if optional and not raw.strip():
        return None
    try:
        data = safe_json.loads(raw)
    except safe_json.UnsafeInput as exc:
        raise _invalid(f"The body is not JSON ADK's API server accepts: {exc}") from None
    if optional and data is None:
        return None
    return model.model_validate(data)


def _invalid(message: str) -> pydantic.ValidationError:
    return pydantic.ValidationError.from_exception_data(
        "body", [{"type": "value_error", "loc": ("body",), "input": None, "ctx": {"error": ValueError(message)}}]
    )


async def _caller(request: HttpRequest, *, throttle: bool = False) -> Any:
    user = await authenticate(request)
    if throttle:
        wait = await sync_to_async(throttle_wait)(scope=CHAT_TURN, request=request, user=user)
        if wait is not None:
            raise drf_exceptions.Throttled(wait=wait, detail="Too many turns.")
    return user


def _methods(request: HttpRequest, *allowed: str) -> JsonResponse | None:
    if request.method in allowed:
        return None
    return detail(405, "Method Not Allowed", code="method_not_allowed", headers={"Allow": ", ".join(allowed)})


def adk_not_found(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
    return detail(404, "Not Found", code="not_found")


# --- Apps -------------------------------------------------------------------------------------------


@csrf_exempt
async def list_apps(request: HttpRequest):
    if refused := _methods(request, "GET"):
        return refused
    try:
        await _caller(request)
    except Exception as exc:  # noqa: BLE001 - translated once, below
        return error_response(exc)
    names = await sync_to_async(runnable_agents)()
    if request.GET.get("detailed", "").lower() not in ("1", "true"):
        return JsonResponse(names, safe=False)
    specs = [AGENTS[name] for name in names]
    return JsonResponse({"apps": [
        {"name": spec.name, "rootAgentName": spec.root.name if spec.root else spec.name,
         "description": spec.description, "language": "python", "isComputerUse": False}
        for spec in specs
    ]})


# --- Sessions -----------------------------------------------------------------------------------------


def _session_json(session: Any) -> dict:
    return _redact_credential_secrets(public_session(session).model_dump(exclude_none=True, by_alias=True, mode="json"))


def _checked(user: Any, app_name: str, user_id: str, session_id: str = "") -> tuple[str, str, str]:
    app = turns.check_app(app_name)
    owner = turns.check_owner(actor=user, app_name=app, user_id=user_id, session_id=session_id)
    return app, owner, turns.clean_session_id(session_id) if session_id else ""


@csrf_exempt
async def sessions(request: HttpRequest, app_name: str, user_id: str):
    if refused := _methods(request, "GET", "POST"):
        return refused
    try:
        user = await _caller(request)
        app, owner, _ = await sync_to_async(_checked)(user, app_name, user_id)
        if request.method == "GET":
            listed = await session_service().list_sessions(app_name=app, user_id=owner)
            return JsonResponse([_session_json(session) for session in listed.sessions], safe=False)
        body = _body(request, CreateSessionRequest, optional=True)
        session_id = None
        state = None
        if body is not None:
            if body.events:
                raise turns.WireRefusal(
                    "A session cannot be created with events here: its events are the evidence of its runs, so only "
                    "runs write them. Create it empty (with state if you like) and send the messages with /run."
                )
            if body.options:
                raise turns.WireRefusal("Session options are not supported by the ledger's session service.")
            state = body.state
            if body.session_id is not None:
                session_id = turns.clean_session_id(body.session_id)
        return await _create(app, owner, session_id, state)
    except Exception as exc:  # noqa: BLE001 - translated once
        return error_response(exc)


async def _create(app: str, owner: str, session_id: str | None, state: Any) -> JsonResponse:
    if state is not None:
        try:
            safe_json.check_value(state, where="state")
        except safe_json.UnsafeInput as exc:
            raise turns.WireRefusal(str(exc)) from None
    if session_id is not None:
        await sync_to_async(turns.check_new_session_id)(session_id)
    try:
        session = await session_service().create_session(
            app_name=app, user_id=owner, state=state, session_id=session_id
        )
    except AlreadyExistsError:
        raise turns.SessionExists(f"Session already exists: {session_id}") from None
    return JsonResponse(_session_json(session))


@csrf_exempt
async def session(request: HttpRequest, app_name: str, user_id: str, session_id: str):
    if request.method == "PATCH":
        return detail(405, "A session's state changes only through its runs (their tools and callbacks): the ledger "
                           "appends no event outside a run.", code="method_not_allowed",
                      headers={"Allow": "GET, POST, DELETE"})
    if refused := _methods(request, "GET", "POST", "DELETE"):
        return refused
    try:
        user = await _caller(request)
        app, owner, sid = await sync_to_async(_checked)(user, app_name, user_id, session_id)
        if request.method == "POST":
            # ADK's deprecated create-with-id: the body, if any, is the initial state.
            state = safe_json.loads(request.body) if (request.body or b"").strip() else None
            if state is not None and not isinstance(state, dict):
                raise _invalid("The body is the session's initial state: a JSON object.")
            return await _create(app, owner, sid, state)
        found = await session_service().get_session(app_name=app, user_id=owner, session_id=sid)
        if found is None:
            raise turns.SessionNotFound(sid)
        if request.method == "GET":
            return JsonResponse(_session_json(found))
        await sync_to_async(turns.check_deletable)(app_name=app, owner_id=owner, session_id=sid)
        await session_service().delete_session(app_name=app, user_id=owner, session_id=sid)
        return JsonResponse(None, safe=False)
    except safe_json.UnsafeInput as exc:
        return error_response(_invalid(str(exc)))
    except Exception as exc:  # noqa: BLE001 - translated once
        return error_response(exc)


# --- /run and /run_sse --------------------------------------------------------------------------------


def _params(req: RunAgentRequest) -> dict | None:
    metadata = req.custom_metadata or {}
    others = sorted(key for key in metadata if key != "params")
    if others:
        raise turns.WireRefusal(
            f"custom_metadata keys {', '.join(others)} are not kept: the ledger stamps its own on every event. "
            "custom_metadata.params is the run's params (as in POST /api/runs/)."
        )
    params = metadata.get("params")
    if params is not None and not isinstance(params, dict):
        raise turns.WireRefusal("custom_metadata.params must be a JSON object: the run's params.")
    return params


def _prepare(user: Any, req: RunAgentRequest) -> tuple[str, AgentRun, set[str]]:
    """('run', a new run to execute here) or ('follow', a waiting run just answered, its events so far)."""
    app, owner, session_id = _checked(user, req.app_name, req.user_id, req.session_id)
    if req.state_delta:
        raise turns.WireRefusal(
            "state_delta is not taken: a session's state changes only through its runs (tools and callbacks)."
        )
    params = _params(req)
    if not turns.session_exists(app_name=app, owner_id=owner, session_id=session_id):
        raise turns.SessionNotFound(session_id)
    responses = turns.function_responses(req.new_message)
    if not responses:
        if req.invocation_id:
            raise turns.WireRefusal(
                "invocation_id resumes a waiting invocation: send it with the function responses that answer its calls."
            )
        run = turns.begin_turn(
            actor=user, app_name=app, owner_id=owner, session_id=session_id, message=req.new_message, params=params
        )
        return "run", run, set()
    if turns.message_text(req.new_message).strip():
        raise turns.WireRefusal("A message that answers waiting calls holds only their function responses.")
    run = turns.waiting_run(app_name=app, owner_id=owner, session_id=session_id)
    if run is None:
        raise turns.NothingWaits(f"No run of session {session_id} waits for an answer.")
    if req.invocation_id and req.invocation_id != run.invocation_id:
        raise turns.WireRefusal(
            f"invocation_id {req.invocation_id} is not the waiting run's invocation ({run.invocation_id})."
        )
    seen = stream.seen_events(run)
    turns.answer_waiting(actor=user, run=run, responses=responses)
    return "follow", run, seen


async def _begin(request: HttpRequest) -> tuple[Any, str, AgentRun, set[str]]:
    user = await _caller(request, throttle=True)
    req = _body(request, RunAgentRequest)
    starting = asyncio.ensure_future(sync_to_async(_prepare)(user, req))
    try:
        # Shielded: a client that leaves while the run is written still gets it settled, not left queued.
        kind, run, seen = await asyncio.shield(starting)
    except asyncio.CancelledError:
        starting.add_done_callback(lambda future: _settle_if_written(future, user))
        raise
    return user, kind, run, seen


def _settle_if_written(future: asyncio.Future, user: Any) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    kind, run, _ = future.result()
    if kind == "run":
        stream.chat.start_abandoned(run)
    else:
        asyncio.ensure_future(stream.cancel_followed(run_id=run.run_id, actor=user))


class _Source:
    """Where a request's events come from, and what to do when its client leaves."""

    def __init__(self, user: Any, kind: str, run: AgentRun, seen: set[str]):
        self.user, self.run = user, run
        self.turn = stream.WireTurn(run) if kind == "run" else None
        self.seen = seen
        self.done = False
        if self.turn is not None:
            self.turn.start()

    def events(self, *, keepalive: float | None = None):
        if self.turn is not None:
            return stream.turn_events(self.turn, keepalive=keepalive)
        return self._followed(keepalive)

    async def _followed(self, keepalive: float | None):
        async for item in stream.follow(self.run, self.seen):
            yield item

    def left(self) -> None:
        if self.done:
            return
        if self.turn is not None and not self.turn.finished:
            self.turn.abandon()
        else:
            chat_task = asyncio.ensure_future(stream.cancel_followed(run_id=self.run.run_id, actor=self.user))
            stream.chat._running.add(chat_task)
            chat_task.add_done_callback(stream.chat._running.discard)


async def _opened(request: HttpRequest) -> _Source | HttpResponse:
    """The turn a POST to `/run` or `/run_sse` begins, or the response that refuses it."""
    if refused := _methods(request, "POST"):
        return refused
    try:
        user, kind, begun, seen = await _begin(request)
    except Exception as exc:  # noqa: BLE001 - translated once
        return error_response(exc)
    return _Source(user, kind, begun, seen)


@csrf_exempt
async def run(request: HttpRequest):
    source = await _opened(request)
    if isinstance(source, HttpResponse):
        return source
    try:
        events = [item async for item in source.events() if item is not None]
        source.done = True
    finally:
        # Cancelled (the client left, and Django cancels the view): the run is cancelled too.
        source.left()
    response = JsonResponse(events, safe=False)
    response["X-Run-Id"] = str(source.run.run_id)
    return response


class RunStream(StreamingHttpResponse):
    """`/run_sse`'s stream: each event as `data: <JSON>`, as ADK's server sends it. Django closes every
    response it started, even one whose client left before the first byte: the run is then cancelled."""

    def __init__(self, source: _Source):
        self.source = source
        super().__init__(self._frames(), content_type="text/event-stream; charset=utf-8")
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"
        self["X-Run-Id"] = str(source.run.run_id)

    def close(self) -> None:
        self.source.left()
        super().close()

    async def _frames(self):
        try:
            async for item in self.source.events(keepalive=settings.CHAT_KEEPALIVE_SECONDS):
                if item is None:
                    yield b": keepalive\n\n"
                    continue
                yield b"data: " + pydantic_core.to_json(item) + b"\n\n"
            failed = await stream.outcome_error(self.source.run.run_id)
            if failed is not None:
                yield b"data: " + pydantic_core.to_json(failed) + b"\n\n"
            self.source.done = True
        finally:
            self.source.left()


@csrf_exempt
async def run_sse(request: HttpRequest):
    source = await _opened(request)
    if isinstance(source, HttpResponse):
        return source
    return RunStream(source)
