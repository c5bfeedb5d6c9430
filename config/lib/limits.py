"""Request body limits, enforced before a body is read.

Django's ASGI handler reads the whole body into a temporary file (spilling to disk past
FILE_UPLOAD_MAX_MEMORY_SIZE) before any view or middleware runs, so a limit checked in a view
comes after a gigabyte was already written to the temp directory. `BodyLimitMiddleware` wraps
the ASGI application instead: a declared Content-Length over the limit is refused without
reading a byte, and a chunked body is counted as it streams in and cut off past the limit.
`body_limit_middleware` (a Django middleware) applies the same rule to the declared length on
every other path (WSGI, the test client), and gives a chunked body that ASGI spooled its length,
so the parsers read it (under WSGI a chunked body is a 411).

The API's parsers (`config.lib.parsers`) read at most the same limits and raise this module's
`RequestTooLarge`, so every limit and its refusal live here.

Each path has its own limit: an upload to `POST /api/runs/` gets MAX_UPLOAD_BYTES plus room for
the form around it, the webhook inbox WEBHOOK_MAX_BYTES, everything else DATA_UPLOAD_MAX_MEMORY_SIZE
(set from MAX_REQUEST_BODY_BYTES).
"""

from __future__ import annotations

import io
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework import exceptions, status

from config.lib.middleware import refusing_middleware

# Room for the form fields and multipart framing around an upload of MAX_UPLOAD_BYTES.
MULTIPART_OVERHEAD_BYTES = 1024 * 1024

UPLOAD_PATH = "/api/runs/"
WEBHOOK_PREFIX = "/api/webhooks/"


@dataclass(frozen=True)
class BodyLimit:
    bytes: int
    setting: str
    # Each door keeps the code it has always answered with (clients match on it).
    code: str = "request_too_large"

    def detail(self) -> str:
        return (
            f"The request body is larger than the limit of {self.bytes} bytes ({self.setting}); "
            "it was refused without being read."
        )

    def body(self) -> dict[str, Any]:
        return {"code": self.code, "detail": self.detail(), "limit": self.bytes}


class RequestTooLarge(exceptions.APIException):
    """A body over its limit found by a parser that reads it (`config.lib.parsers`) or by Django
    (`RequestDataTooBig`, too many fields); answered in the API's error format."""

    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "request_too_large"
    default_detail = "The request body is too large."


def body_limit(*, method: str, path: str, content_type: str) -> BodyLimit:
    """The most bytes a request to `path` may carry, and the setting that says so."""
    if path.startswith(WEBHOOK_PREFIX):
        return BodyLimit(settings.WEBHOOK_MAX_BYTES, "WEBHOOK_MAX_BYTES", code="body_too_large")
    if method == "POST" and path == UPLOAD_PATH and content_type.lower().startswith("multipart/form-data"):
        return BodyLimit(settings.MAX_UPLOAD_BYTES + MULTIPART_OVERHEAD_BYTES, "MAX_UPLOAD_BYTES")
    return BodyLimit(settings.DATA_UPLOAD_MAX_MEMORY_SIZE, "MAX_REQUEST_BODY_BYTES")


def _declared_length(value: str | bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# --- ASGI: in front of Django -------------------------------------------------------------------------

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


async def _send_refusal(send: Callable[[dict], Awaitable[None]], limit: BodyLimit) -> None:
    payload = json.dumps(limit.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                # The rest of the body is never read, so the connection cannot be reused.
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class BodyLimitMiddleware:
    """Wraps the ASGI application: refuses oversized bodies, declared or streamed, with a 413."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in scope.get("headers", [])}
        limit = body_limit(
            method=scope.get("method", "GET"),
            path=scope.get("path", ""),
            content_type=headers.get(b"content-type", b"").decode("latin-1"),
        )
        declared = _declared_length(headers.get(b"content-length"))
        if declared is not None and declared > limit.bytes:
            await _send_refusal(send, limit)
            return

        received = 0
        over = False
        started = False

        async def counted_receive() -> dict:
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit.bytes:
                    # Django's handler treats a disconnect while reading as an aborted request:
                    # it stops reading, answers nothing, and the refusal is sent below instead.
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counted_receive, tracked_send)
        if over and not started:
            await _send_refusal(send, limit)


# --- Django: the same rule on the declared length -------------------------------------------------------


def _chunked(request: HttpRequest) -> bool:
    return "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower()


def _spooled_length(request: ASGIRequest) -> int:
    """The size of a body Django's ASGI handler has already read (within the limit, counted above)."""
    body_file = request._stream
    position = body_file.tell()
    body_file.seek(0, io.SEEK_END)
    size = body_file.tell()
    body_file.seek(position)
    return size


LENGTH_REQUIRED = {
    "code": "length_required",
    "detail": (
        "A chunked request body (Transfer-Encoding: chunked, no Content-Length) cannot be read by this "
        "server: send the body with a Content-Length."
    ),
}


def refusal_for(request: HttpRequest) -> HttpResponse | None:
    limit = body_limit(
        method=request.method or "GET", path=request.path_info, content_type=request.META.get("CONTENT_TYPE", "")
    )
    declared = _declared_length(request.META.get("CONTENT_LENGTH"))
    if declared is None and _chunked(request):
        # DRF and Django's form parsers read a body only as far as CONTENT_LENGTH says, so a
        # chunked one would parse as no body at all (and a JSON start as "this field is required").
        # Under ASGI the whole body is already spooled, cut off past its limit by
        # BodyLimitMiddleware: its length is known, and declared here for the parsers. A WSGI
        # server hands Django a stream it reads nothing of without a length: refused, saying why.
        if not isinstance(request, ASGIRequest):
            return JsonResponse(LENGTH_REQUIRED, status=411)
        declared = _spooled_length(request)
        request.META["CONTENT_LENGTH"] = str(declared)
    if declared is not None and declared > limit.bytes:
        return JsonResponse(limit.body(), status=413)
    return None


# First in MIDDLEWARE: nothing after it reads a body the limit refuses.
body_limit_middleware = refusing_middleware(refusal_for)
