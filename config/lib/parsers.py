"""The API's request parsers: strict JSON (`config.lib.safe_json`), never reading past the limits of
`config.lib.limits`."""

from __future__ import annotations

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

from config.lib.limits import MULTIPART_OVERHEAD_BYTES, RequestTooLarge
from config.lib.safe_json import UnsafeInput, loads


def _content_length(meta) -> int:
    try:
        return int(meta.get("CONTENT_LENGTH") or 0)
    except (TypeError, ValueError):
        return 0


class StrictJSONParser(parsers.JSONParser):
    """DRF's JSON parser with `safe_json.loads`; reads at most DATA_UPLOAD_MAX_MEMORY_SIZE bytes.

    DRF reads a JSON body from the stream with no limit of its own, and a chunked body declares
    no length for the limits in front of Django to refuse.
    """

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        body = stream.read(limit + 1) if stream is not None else b""
        if limit is not None and len(body) > limit:
            raise RequestTooLarge(
                f"The request body is larger than the limit of {limit} bytes (MAX_REQUEST_BODY_BYTES); "
                "attach large inputs as a multipart file."
            )
        if not body:
            raise ParseError("The body is empty: send a JSON object.")
        try:
            return loads(body)
        except UnsafeInput as exc:
            raise ParseError(str(exc)) from None


class BoundedMultiPartParser(parsers.MultiPartParser):
    def parse(self, stream, media_type=None, parser_context=None):
        request = parser_context["request"]
        limit = settings.MAX_UPLOAD_BYTES + MULTIPART_OVERHEAD_BYTES
        if _content_length(request.META) > limit:
            raise RequestTooLarge(
                f"The upload is larger than the limit of {settings.MAX_UPLOAD_BYTES} bytes (MAX_UPLOAD_BYTES)."
            )
        return super().parse(stream, media_type, parser_context)
