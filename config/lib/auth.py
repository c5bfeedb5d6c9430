"""API tokens that expire: DRF's token, refused once it is older than API_TOKEN_TTL_DAYS.

DRF's tokens never expire on their own, so a key copied into a script or a log years ago still
acts. A token's age is its `created`; an expired one answers 401 `token_expired` naming the way
to a new one (`manage.py drf_create_token -r USERNAME`, or the admin), and is never refreshed
silently. `API_TOKEN_TTL_DAYS=0` keeps them for ever.

Guessing keys is paced: past THROTTLE_RATES["auth.failed_token"] failed authentications from one
client address (THROTTLE_FAILED_TOKENS, e.g. 20/min), that address is answered 429 with
Retry-After, whatever key it sends, until the period ends. Counted in the default cache.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.utils import timezone
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication
from rest_framework.throttling import SimpleRateThrottle

from config.lib.client_ip import client_ip

FAILED_TOKENS = "auth.failed_token"


class TokenExpired(exceptions.AuthenticationFailed):
    default_code = "token_expired"


def is_expired(created, *, now=None) -> bool:
    days = settings.API_TOKEN_TTL_DAYS
    if not days:
        return False
    return created + timedelta(days=days) <= (now or timezone.now())


def _failed_token_rate() -> tuple[int | None, int | None]:
    return SimpleRateThrottle.parse_rate(None, settings.THROTTLE_RATES.get(FAILED_TOKENS))


def _failures_key(address: str) -> str:
    return f"token-failures:{address}"


def check_not_guessing(address: str | None) -> None:
    """429 for an address past its failed authentications in this period."""
    limit, period = _failed_token_rate()
    if limit is None or not address:
        return
    if (cache.get(_failures_key(address)) or 0) >= limit:
        raise exceptions.Throttled(
            wait=period,
            detail=f"Too many failed token authentications from your address (THROTTLE_FAILED_TOKENS, "
                   f"{settings.THROTTLE_RATES[FAILED_TOKENS]}); try again later with a valid token.",
        )


def record_failure(address: str | None) -> None:
    limit, period = _failed_token_rate()
    if limit is None or not address:
        return
    key = _failures_key(address)
    # The window starts at the first failure: `add` sets it only if absent, `incr` keeps its expiry.
    cache.add(key, 0, timeout=period)
    try:
        cache.incr(key)
    except ValueError:  # expired between the two calls
        cache.add(key, 1, timeout=period)


def authenticate_key(key: str, *, address: str | None):
    """(user, token) for an API key sent from `address`; failures there are counted and paced."""
    check_not_guessing(address)
    try:
        return ExpiringTokenAuthentication().authenticate_credentials(key)
    except exceptions.AuthenticationFailed:
        record_failure(address)
        raise


PACED_RESPONSE = {
    "description": "Too many failed token authentications from your address (THROTTLE_FAILED_TOKENS); "
                   "Retry-After says when to try again.",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}


def add_auth_pacing_to_schema(result, generator, request, public):
    """drf-spectacular hook: every operation that may answer 401 may also answer the pacing's 429."""
    for path_item in (result.get("paths") or {}).values():
        for operation in path_item.values():
            responses = operation.get("responses") if isinstance(operation, dict) else None
            if responses and "401" in responses and "429" not in responses:
                responses["429"] = dict(PACED_RESPONSE)
    return result


class ExpiringTokenAuthentication(TokenAuthentication):
    def authenticate(self, request):
        address = client_ip(request)
        check_not_guessing(address)
        try:
            return super().authenticate(request)
        except exceptions.AuthenticationFailed:
            record_failure(address)
            raise

    def authenticate_credentials(self, key):
        user, token = super().authenticate_credentials(key)
        if is_expired(token.created):
            raise TokenExpired(
                f"The token expired: tokens last {settings.API_TOKEN_TTL_DAYS} days (API_TOKEN_TTL_DAYS). "
                "Ask for a new one (manage.py drf_create_token -r USERNAME, or the admin's Tokens page).",
                code="token_expired",
            )
        return user, token


def key_prefix(key: str) -> str:
    """Enough of a key to tell tokens apart on a page; never enough to use it."""
    return f"{key[:6]}…" if key else ""
