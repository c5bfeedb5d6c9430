"""What an error page shows: the debug page renders whatever a frame holds, and never a secret.

Every secret below is spelled in two pieces, so that the page's excerpt of this very source file
cannot be what shows it: only a value the filter failed to hide can.
"""

from __future__ import annotations

import sys
from collections import namedtuple

import pytest
from django.db.backends.postgresql.base import DatabaseWrapper
from django.db.utils import OperationalError
from django.test import RequestFactory
from django.views.debug import technical_500_response

PASSWORD = "pg-pass" + "word-7781"


def debug_page(request) -> str:
    return technical_500_response(request, *sys.exc_info()).content.decode()


def test_a_database_outage_on_the_login_page_never_shows_the_password(settings, django_db_blocker):
    settings.DEBUG = True
    unreachable = DatabaseWrapper({
        "ENGINE": "django.db.backends.postgresql", "NAME": "ledger", "USER": "ledger", "PASSWORD": PASSWORD,
        # Port 1 on loopback: nothing listens, so the connection is refused at once.
        "HOST": "127.0.0.1", "PORT": "1", "OPTIONS": {}, "CONN_MAX_AGE": 0, "CONN_HEALTH_CHECKS": False,
        "AUTOCOMMIT": True, "ATOMIC_REQUESTS": False, "TIME_ZONE": None, "TEST": {},
    })
    request = RequestFactory().post("/admin/login/", {"username": "x", "password": "typed-" + "by-a-stranger"})
    request.sensitive_post_parameters = ["password"]  # as the admin's login view marks it
    try:
        with django_db_blocker.unblock():  # a connection of its own, to a server that is not there
            unreachable.ensure_connection()
    except OperationalError:
        page = debug_page(request)
    else:  # pragma: no cover - something listens on port 1
        pytest.skip("port 1 on loopback accepted a connection")
    assert "conn_params" in page  # the frames that hold the password are on the page
    assert PASSWORD not in page
    assert "typed-" + "by-a-stranger" not in page  # the admin marks it sensitive; DEBUG does not lift that


class _Account:
    def __init__(self, dsn: str):
        self.dsn = dsn

    def __repr__(self) -> str:
        return f"<Account {self.dsn}>"


class _BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr broke")


class _NeedsArgument(dict):
    def __init__(self, required):
        super().__init__(required=required)


def test_the_filter_renders_any_frame_without_crashing_or_leaking(settings):
    settings.DEBUG = True
    Point = namedtuple("Point", "x y")
    point = Point(1, "postgres://u:nt" + "-secret@h/db")  # noqa: F841 (locals shown on the page)
    looped: list = ["postgres://u:loop" + "-secret@h/db"]
    looped.append(looped)
    nested = {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": {"password": "deep" + "-secret"}}}}}}}}}}  # noqa: F841
    account = _Account("postgres://u:obj" + "-secret@h/db")  # noqa: F841
    broken = _BrokenRepr()  # noqa: F841
    needs = _NeedsArgument("dsn password=arg" + "-secret")  # noqa: F841
    api_token = "tok" + "-secret"  # noqa: F841
    blob = b"password=bytes" + b"-secret"  # noqa: F841
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        page = debug_page(RequestFactory().get("/"))
    assert "boom" in page
    for secret in ("nt", "loop", "deep", "obj", "arg", "tok", "bytes"):
        assert f"{secret}-secret" not in page, secret
