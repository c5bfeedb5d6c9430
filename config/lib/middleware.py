"""A middleware that answers for the request before the rest of the stack sees it, sync or async."""

from __future__ import annotations

from collections.abc import Callable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse


def refusing_middleware(refusal_for: Callable[[HttpRequest], HttpResponse | None]):
    """Build a middleware that returns `refusal_for(request)` when it refuses, else passes the request on."""

    def factory(get_response):
        if iscoroutinefunction(get_response):

            async def middleware(request: HttpRequest) -> HttpResponse:
                return refusal_for(request) or await get_response(request)

            markcoroutinefunction(middleware)
        else:

            def middleware(request: HttpRequest) -> HttpResponse:
                return refusal_for(request) or get_response(request)

        return middleware

    factory.sync_capable = True
    factory.async_capable = True
    return factory
