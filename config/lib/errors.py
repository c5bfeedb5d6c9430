"""What an error may show: never a secret on the debug page, never exception text to a client.

`SecretHidingReporterFilter` (DEFAULT_EXCEPTION_REPORTER_FILTER) is what Django's debug page and
its error mails use to list settings, request metadata and traceback variables. Django's own
filter hides settings named like API/KEY/SECRET/PASS/TOKEN, but not DATABASE_URL, whose value
carries the database password, nor the drivers' dicts in traceback frames (`conn_params` of a
failed connection holds the password); this one also hides DSN-like names, values under
secret-like keys at any depth, and the password of any URL or DSN, whatever the setting or
variable is called, and it stays on under DEBUG.

`api_error_middleware` answers an unhandled exception under /api/ with a summary in the API's
error format even under DEBUG (where Django would send its technical page, exception text and
all, to whatever client asked). Outside DEBUG, handler500 already does the same.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from django.conf import settings
from django.core import signals
from django.http import HttpRequest, JsonResponse
from django.utils.deprecation import MiddlewareMixin
from django.utils.functional import LazyObject
from django.views.debug import SafeExceptionReporterFilter

from config.lib.redact import redact

logger = logging.getLogger("django.request")

INTERNAL_ERROR = {
    "code": "server_error",
    "detail": "The server failed to answer this request; the error has been logged.",
}


HIDDEN_NAMES = re.compile(
    "API|AUTH|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|DATABASE_URL|DSN|CREDENTIAL|PRIVATE|CONNINFO",
    flags=re.IGNORECASE,
)
# Past this depth (or for a container that holds itself) a value is not walked further, nor shown.
MAX_DEPTH = 8


class _Shown:
    """A value the debug page prints as the given (already redacted) text: pprint uses repr."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown_repr(value: Any) -> _Shown:
    try:
        return _Shown(redact(repr(value)))
    except Exception as exc:  # a repr that raises is the object's problem, not the error page's
        return _Shown(f"<{type(value).__name__}: repr failed with {type(exc).__name__}>")


def _is_hidden_name(key: Any) -> bool:
    return isinstance(key, str) and bool(HIDDEN_NAMES.search(key))


def _redacted(value: Any, *, substitute: str, depth: int = 0, seen: frozenset[int] = frozenset()) -> Any:
    """`value` with secrets masked: passwords in URLs and DSNs, and values under secret-like keys.

    Database drivers keep the password in plain dicts (`conn_params`, `settings_dict`, psycopg's
    keyword arguments) that the debug page would print from every frame of a failed connection.
    Never raises: whatever the value, the error page still renders.
    """
    try:
        if isinstance(value, LazyObject):
            return value  # a lazy object claims its target's class; it is not a string to rewrite
        if isinstance(value, str):
            return redact(value)
        if isinstance(value, bytes | bytearray):
            return _shown_repr(value)
        if not isinstance(value, dict | list | tuple | set | frozenset):
            return value if isinstance(value, int | float | bool | type(None)) else _shown_repr(value)
        if id(value) in seen:
            return _Shown(f"<the enclosing {type(value).__name__}>")
        if depth >= MAX_DEPTH:
            return _Shown(f"<{type(value).__name__} nested too deep to check for secrets>")
        inner = {"substitute": substitute, "depth": depth + 1, "seen": seen | {id(value)}}
        if isinstance(value, dict):
            return {
                key: substitute if _is_hidden_name(key) else _redacted(item, **inner) for key, item in value.items()
            }
        items = [_redacted(item, **inner) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    except Exception as exc:
        return _Shown(f"<{type(value).__name__}: not shown ({type(exc).__name__} while hiding secrets)>")


class SecretHidingReporterFilter(SafeExceptionReporterFilter):
    hidden_settings = HIDDEN_NAMES

    def is_active(self, request):
        # Django's filter stands down under DEBUG; the debug page is the one most likely to be
        # seen by a stranger (an anonymous login that hit a database outage), so this one never does.
        return True

    def cleanse_setting(self, key, value):
        return _redacted(super().cleanse_setting(key, value), substitute=self.cleansed_substitute)

    def get_traceback_frame_variables(self, request, tb_frame):
        return [
            (name, self.cleansed_substitute if _is_hidden_name(name) else _redacted(value, substitute=self.cleansed_substitute))
            for name, value in super().get_traceback_frame_variables(request, tb_frame)
        ]


class APIErrorMiddleware(MiddlewareMixin):
    """Under DEBUG, an API client gets the summary, not the technical page."""

    def process_exception(self, request: HttpRequest, exception: Exception):
        if not settings.DEBUG or not request.path.startswith("/api/"):
            return None
        logger.error(
            "Internal Server Error: %s",
            request.path,
            exc_info=exception,
            extra={"status_code": 500, "request": request},
        )
        # Listeners (error trackers, the test client) hear of it as they would without DEBUG.
        signals.got_request_exception.send(sender=None, request=request)
        return JsonResponse(INTERNAL_ERROR, status=500)
