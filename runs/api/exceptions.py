"""Every API error is `{"code", "detail", ...}`: refusals, validation, and DRF's own errors."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from runs.refusals import Refusal

logger = logging.getLogger(__name__)


class RequestTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "request_too_large"
    default_detail = "The request body is too large."


class InvalidCursor(exceptions.APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "invalid_cursor"
    default_detail = "The cursor is not one this API gave out; start again from the first page."


def _flatten(errors: Any, prefix: str = "") -> list[str]:
    if isinstance(errors, dict):
        lines = []
        for key, value in errors.items():
            lines.extend(_flatten(value, f"{prefix}{key}: " if key != "non_field_errors" else prefix))
        return lines
    if isinstance(errors, list | tuple):
        return [line for item in errors for line in _flatten(item, prefix)]
    return [f"{prefix}{errors}"]


def validation_body(errors: Any) -> dict[str, Any]:
    if not isinstance(errors, dict):
        errors = {"non_field_errors": errors if isinstance(errors, list) else [errors]}
    return {"code": "invalid", "detail": "The request is invalid. " + " ".join(_flatten(errors)), "errors": errors}


def _code_of(exc: exceptions.APIException) -> str:
    codes = exc.get_codes()
    return codes if isinstance(codes, str) else exc.default_code


def api_exception_handler(exc: Exception, context: dict) -> Response | None:
    if isinstance(exc, Refusal):
        return Response(exc.as_dict(), status=exc.status)
    if isinstance(exc, DjangoValidationError):
        errors = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        return Response(validation_body(errors), status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, RequestDataTooBig):
        exc = RequestTooLarge(
            f"The request body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes "
            "(DATA_UPLOAD_MAX_MEMORY_SIZE); attach large inputs as a multipart file."
        )
    elif isinstance(exc, TooManyFieldsSent | TooManyFilesSent):
        exc = RequestTooLarge(f"The request is too large: {exc}")
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound("Not found: no such run, or not one you can see.")
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()

    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        response.data = validation_body(response.data)
    else:
        response.data = {"code": _code_of(exc), "detail": str(exc.detail)}
    return response


def server_error_body() -> dict[str, str]:
    return {
        "code": "server_error",
        "detail": "The server failed to answer this request; the error has been logged.",
    }


def api_server_error(request, *args, **kwargs):
    """handler500: JSON for the API, Django's page for everything else."""
    if request.path.startswith("/api/"):
        return JsonResponse(server_error_body(), status=500)
    from django.views.defaults import server_error

    return server_error(request, *args, **kwargs)
