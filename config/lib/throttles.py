"""Request rates per user for the doors that start work: runs, replays, chat turns.

The rates live in the THROTTLE_RATES setting (read from the environment) and are looked up at
each request, so they follow the settings in force. A view names the scope of each of its
actions in `throttle_scopes` (or one `throttle_scope`). History is kept in the default cache:
share it between web replicas (a cache every replica reaches) for the rate to be global.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from rest_framework.throttling import SimpleRateThrottle

START_RUN = "runs.start"
REPLAY = "runs.replay"
CHAT_TURN = "chat.turn"


class ScopedUserRateThrottle(SimpleRateThrottle):
    """At most THROTTLE_RATES[scope] requests per user (or per client address, anonymously)."""

    def __init__(self, scope: str | None = None):
        # The rate is resolved per request from the view's scope, not once at import.
        self.scope = scope

    def _configure(self, scope: str | None) -> None:
        self.scope = scope
        self.rate = settings.THROTTLE_RATES.get(scope) if scope else None
        self.num_requests, self.duration = self.parse_rate(self.rate)

    def allow_request(self, request, view) -> bool:
        scope = self.scope
        if view is not None:
            action = getattr(view, "action", None)
            scope = getattr(view, "throttle_scopes", {}).get(action) or getattr(view, "throttle_scope", None)
        self._configure(scope)
        return super().allow_request(request, view)

    def get_cache_key(self, request, view) -> str | None:
        user = getattr(request, "user", None)
        ident = user.pk if user is not None and user.is_authenticated else self.get_ident(request)
        return self.cache_format % {"scope": self.scope, "ident": ident}


class _UserRequest:
    """What a throttle reads of a request whose user was authenticated outside DRF."""

    def __init__(self, request: Any, user: Any):
        self.user = user
        self.META = request.META


def throttle_wait(*, scope: str, request: Any, user: Any) -> float | None:
    """None if the request may go on; else the seconds to wait (for Retry-After)."""
    throttle = ScopedUserRateThrottle(scope)
    if throttle.allow_request(_UserRequest(request, user), None):
        return None
    return throttle.wait() or 1.0
