"""A Content-Security-Policy on the admin's pages (ADMIN_CONTENT_SECURITY_POLICY).

The admin shows what agents, tools and users wrote (model text, arguments, notes). It is escaped,
and the policy is the second line: scripts only from this server, no plugins, no framing, forms
posting only here. Inline styles stay allowed, as Django's admin templates use them. The API
answers JSON and the pages of the desk are the admin, so the header is set under /admin/ only.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse

HEADER = "Content-Security-Policy"
ADMIN_PREFIX = "/admin/"


def _with_policy(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    policy = settings.ADMIN_CONTENT_SECURITY_POLICY
    if policy and request.path.startswith(ADMIN_PREFIX) and HEADER not in response:
        response[HEADER] = policy
    return response


def csp_middleware(get_response):
    # Sync and async alike: the ASGI server's streamed chat turns pass through here untouched.
    if iscoroutinefunction(get_response):

        async def middleware(request: HttpRequest) -> HttpResponse:
            return _with_policy(request, await get_response(request))

        markcoroutinefunction(middleware)
    else:

        def middleware(request: HttpRequest) -> HttpResponse:
            return _with_policy(request, get_response(request))

    return middleware


csp_middleware.sync_capable = True
csp_middleware.async_capable = True
