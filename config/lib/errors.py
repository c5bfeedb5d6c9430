"""What an error may show: never a secret on the debug page, never exception text to a client.

`SecretHidingReporterFilter` (DEFAULT_EXCEPTION_REPORTER_FILTER) is what Django's debug page and
its error mails use to list settings, request metadata and traceback variables. Django's own
filter hides settings named like API/KEY/SECRET/PASS/TOKEN, but not DATABASE_URL, whose value
carries the database password; this one also hides DSN-like names and masks the password of any
URL or DSN, whatever the setting or variable is called.

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


def _redacted(value: Any) -> Any:
    if isinstance(value, LazyObject):
        return value  # a lazy object claims its target's class; it is not a string to rewrite
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: _redacted(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_redacted(item) for item in value)
    return value


class SecretHidingReporterFilter(SafeExceptionReporterFilter):
    hidden_settings = re.compile(
        "API|AUTH|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|DATABASE_URL|DSN|CREDENTIAL|PRIVATE", flags=re.IGNORECASE
    )

    def cleanse_setting(self, key, value):
        return _redacted(super().cleanse_setting(key, value))

    def get_traceback_frame_variables(self, request, tb_frame):
        return [(name, _redacted(value)) for name, value in super().get_traceback_frame_variables(request, tb_frame)]


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
