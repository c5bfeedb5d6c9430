"""Request parsers that never read more than the limits allow."""

from __future__ import annotations

import io

from django.conf import settings
from rest_framework import parsers

from config.lib.api_errors import RequestTooLarge
from config.lib.safe_json import StrictJSONParser

# Room for the form fields and multipart framing around an upload of MAX_UPLOAD_BYTES.
MULTIPART_OVERHEAD_BYTES = 1024 * 1024


def _content_length(meta) -> int:
    try:
        return int(meta.get("CONTENT_LENGTH") or 0)
    except (TypeError, ValueError):
        return 0


class BoundedJSONParser(StrictJSONParser):
    """DRF reads a JSON body from the stream with no limit of its own: read at most the limit, strictly."""

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        body = stream.read(limit + 1) if stream is not None else b""
        if limit is not None and len(body) > limit:
            raise RequestTooLarge(
                f"The request body is larger than {limit} bytes (DATA_UPLOAD_MAX_MEMORY_SIZE); "
                "attach large inputs as a multipart file."
            )
        return super().parse(io.BytesIO(body), media_type, parser_context)


class BoundedMultiPartParser(parsers.MultiPartParser):
    def parse(self, stream, media_type=None, parser_context=None):
        request = parser_context["request"]
        limit = settings.MAX_UPLOAD_BYTES + MULTIPART_OVERHEAD_BYTES
        if _content_length(request.META) > limit:
            raise RequestTooLarge(
                f"The upload is larger than the limit of {settings.MAX_UPLOAD_BYTES} bytes (MAX_UPLOAD_BYTES)."
            )
        return super().parse(stream, media_type, parser_context)
