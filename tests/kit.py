"""The test client kit: users, tokens, clients and the assert every door's refusal shares.

One copy for every test module: `api(user)` (the API as a signed-in user), `api_as(user)` (the API
with the user's DRF token, as an internal tool calls it), `login(user)` (the admin as a signed-in
person), `with_permissions(user, codenames)` and `refused(response, status, code, *fragments)` (a
refusal as every door says it: JSON `{code, detail}`). The personas themselves are fixtures in
tests/conftest.py.
"""

from __future__ import annotations

from django.contrib.auth.models import Permission
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient


def with_permissions(user, codenames: list[str]):
    """The user, granted these permissions of any app by codename."""
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    return user


def token_for(user) -> str:
    """The user's DRF token (made on first use)."""
    token, _ = Token.objects.get_or_create(user=user)
    return token.key


def api(user) -> APIClient:
    """An API client signed in as `user` (no token: the session's user)."""
    client = APIClient()
    client.force_authenticate(user)
    return client


def api_as(user) -> APIClient:
    """An API client calling as `user` with their DRF token, as an internal tool does."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user)}")
    return client


def login(user) -> Client:
    """The admin's client, signed in as `user`."""
    client = Client()
    client.force_login(user)
    return client


def refused(response, status: int, code: str | None = None, *fragments: str) -> dict:
    """A refusal as the API says one: `status`, JSON `{code, detail, …}`, the code, and each fragment in its detail."""
    assert response.status_code == status, response.content[:400]
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body = response.json()
    assert set(body) >= {"code", "detail"}, body
    if code is not None:
        assert body["code"] == code, body
    for fragment in fragments:
        assert fragment in body["detail"], body["detail"]
    return body
