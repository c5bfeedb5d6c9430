"""API tokens expire (API_TOKEN_TTL_DAYS), on every door, and the admin never lists a whole key."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from tests.kit import login

pytestmark = pytest.mark.django_db


def token_aged(user, days: float) -> Token:
    token = Token.objects.create(user=user)
    Token.objects.filter(pk=token.pk).update(created=timezone.now() - timedelta(days=days))
    return token


def with_token(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def test_a_token_older_than_its_lifetime_is_refused(alice, settings):
    settings.API_TOKEN_TTL_DAYS = 30
    old = token_aged(alice, 31)
    response = with_token(old.key).get("/api/runs/")
    assert response.status_code == 401
    body = response.json()
    assert body["code"] == "token_expired"
    assert "API_TOKEN_TTL_DAYS" in body["detail"]


def test_a_token_within_its_lifetime_works(alice, settings):
    settings.API_TOKEN_TTL_DAYS = 30
    assert with_token(token_aged(alice, 29).key).get("/api/runs/").status_code == 200


def test_zero_keeps_tokens_for_ever(alice, settings):
    settings.API_TOKEN_TTL_DAYS = 0
    assert with_token(token_aged(alice, 3650).key).get("/api/runs/").status_code == 200


def test_the_chat_door_refuses_an_expired_token_too(alice, settings):
    settings.API_TOKEN_TTL_DAYS = 30
    response = Client().post("/api/chat/", {"agent": "support", "message": "hi"}, content_type="application/json",
                             HTTP_AUTHORIZATION=f"Token {token_aged(alice, 31).key}")
    assert response.status_code == 401
    assert response.json()["code"] == "token_expired"


def test_tokens_expire_after_90_days_by_default():
    from django.conf import settings

    assert settings.API_TOKEN_TTL_DAYS == 90


def test_the_admin_lists_only_a_prefix_of_each_key(admin_user, alice):
    token = Token.objects.create(user=alice)
    client = login(admin_user)
    page = client.get("/admin/runs/apitoken/").content.decode()
    assert token.key[:6] in page
    assert token.key not in page
    change = client.get(f"/admin/runs/apitoken/{alice.pk}/change/")
    assert change.status_code == 200
    assert token.key not in change.content.decode()
    history = client.get(f"/admin/runs/apitoken/{alice.pk}/history/", follow=True).content.decode()
    assert token.key not in history


def test_a_new_key_is_shown_once_when_it_is_made(admin_user, bob):
    client = login(admin_user)
    response = client.post("/admin/runs/apitoken/add/", {"user": bob.pk}, follow=True)
    key = Token.objects.get(user=bob).key
    assert key in response.content.decode()
    assert key not in client.get("/admin/runs/apitoken/").content.decode()
    from django.contrib.admin.models import LogEntry

    assert all(key not in entry.object_repr for entry in LogEntry.objects.all())
