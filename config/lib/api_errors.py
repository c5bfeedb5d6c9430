"""Every API error is `{"code", "detail", ...}`: refusals, validation, and DRF's own errors.

The API's one translation of the refusal family (`config.lib.refusals.Refusal`), the error
shape the OpenAPI schema documents (`ErrorSerializer`, `ERRORS`), the JSON 404 for unknown
`/api/` paths and the JSON 500.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import DisallowedHost, RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, JsonResponse
from django.urls import Resolver404, resolve
from django.views.defaults import bad_request, server_error
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions, serializers, status
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from config.lib.limits import RequestTooLarge
from config.lib.refusals import Refusal, TooLargeInput

logger = logging.getLogger(__name__)


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
        if isinstance(exc, TooLargeInput):
            body = {"code": "request_too_large", "detail": " ".join(_flatten(errors)), "limit": exc.limit,
                    "errors": errors}
            return Response(body, status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
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

    return server_error(request, *args, **kwargs)


def invalid_host_body() -> dict:
    # The host is not echoed: the client sent it, and the Host header is not the place to learn names.
    return {"code": "invalid_host", "detail": "The request's Host header is not one this server answers to "
            "(ALLOWED_HOSTS)."}


def api_bad_request(request, exception, *args, **kwargs):
    """handler400: a suspicious request (an unknown Host, a bad multipart boundary) under /api/ answers JSON."""
    if not request.path.startswith("/api/"):
        return bad_request(request, exception, *args, **kwargs)
    if isinstance(exception, DisallowedHost):
        body = invalid_host_body()
    else:
        body = {"code": "bad_request", "detail": "The request is malformed and was refused."}
    return JsonResponse(body, status=400)


class ErrorSerializer(serializers.Serializer):
    code = serializers.CharField(help_text="Stable machine-readable code, e.g. tools_called.")
    detail = serializers.CharField(help_text="A sentence a person can act on.")
    errors = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()), required=False,
        help_text="Field errors (code invalid).",
    )
    tools = serializers.ListField(child=serializers.CharField(), required=False,
                                  help_text="The tools the run already called, once each, in first-call order.")
    replay_run_id = serializers.UUIDField(required=False, help_text="The replay that blocks this one.")
    status = serializers.CharField(required=False, help_text="The run's status, where it matters.")
    replay_status = serializers.CharField(required=False, help_text="The blocking replay's status.")
    input_file_name = serializers.CharField(required=False, help_text="The input file that is gone.")
    run_id = serializers.CharField(required=False, help_text="The run that was not found.")
    limit = serializers.IntegerField(required=False, help_text="The limit that was exceeded.")


ERRORS = {
    400: OpenApiResponse(ErrorSerializer, description="Bad input; `errors` names each field."),
    401: OpenApiResponse(ErrorSerializer, description="No or bad credentials."),
    403: OpenApiResponse(ErrorSerializer, description="Not allowed."),
    404: OpenApiResponse(ErrorSerializer, description="No such run, or not one you can see."),
    409: OpenApiResponse(ErrorSerializer, description="Refused by the replay rules, or the run's state."),
    410: OpenApiResponse(ErrorSerializer, description="The run's stored input file is gone."),
    413: OpenApiResponse(ErrorSerializer, description="The request body is too large."),
    415: OpenApiResponse(ErrorSerializer, description="Send JSON (or multipart to attach a file)."),
    429: OpenApiResponse(ErrorSerializer, description="Too many requests, or too much work in flight; see Retry-After."),
}


def errors(*codes: int) -> dict:
    """The schema's error responses for these status codes."""
    return {code: ERRORS[code] for code in codes}


@extend_schema(exclude=True)
@api_view(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
@authentication_classes([])
@permission_classes([AllowAny])
def api_not_found(request, *args, **kwargs):
    """Unknown paths under /api/ answer in the API's error format, not with an HTML page."""
    detail = f"There is no API endpoint at {request.path}."
    if not request.path.endswith("/"):
        try:
            match = resolve(request.path + "/")
            if match.func is not api_not_found:
                detail += f" Did you mean {request.path}/ ?"
        except Resolver404:
            pass
    return Response({"code": "not_found", "detail": detail}, status=status.HTTP_404_NOT_FOUND)
