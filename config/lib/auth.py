"""API tokens that expire: DRF's token, refused once it is older than API_TOKEN_TTL_DAYS.

DRF's tokens never expire on their own, so a key copied into a script or a log years ago still
acts. A token's age is its `created`; an expired one answers 401 `token_expired` naming the way
to a new one (`manage.py drf_create_token -r USERNAME`, or the admin), and is never refreshed
silently. `API_TOKEN_TTL_DAYS=0` keeps them for ever.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.utils import timezone
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication


class TokenExpired(exceptions.AuthenticationFailed):
    default_code = "token_expired"


def is_expired(created, *, now=None) -> bool:
    days = settings.API_TOKEN_TTL_DAYS
    if not days:
        return False
    return created + timedelta(days=days) <= (now or timezone.now())


class ExpiringTokenAuthentication(TokenAuthentication):
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
