"""An unknown Host on the API answers the API's JSON 400, under DEBUG too.

Django answers a Host outside ALLOWED_HOSTS where something first reads it (`request.get_host()`),
with handler400 when DEBUG is off but with its HTML technical page when DEBUG is on: so the API
reads it first, here, and answers as `config.lib.api_errors.api_bad_request` does. The admin and
the pages keep Django's own answer.
"""

from __future__ import annotations

from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse, JsonResponse

from config.lib.api_errors import invalid_host_body
from config.lib.middleware import refusing_middleware


def refusal_for(request: HttpRequest) -> HttpResponse | None:
    if not request.path.startswith("/api/"):
        return None
    try:
        request.get_host()
    except DisallowedHost:
        return JsonResponse(invalid_host_body(), status=400)
    return None


host_guard_middleware = refusing_middleware(refusal_for)
