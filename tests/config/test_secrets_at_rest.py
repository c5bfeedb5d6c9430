"""Webhook secrets are encrypted at rest (SECRETS_ENCRYPTION_KEYS), read back for signing, and rotate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from cryptography.fernet import Fernet
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connection

from config.lib import crypto
from runs.inbox import signing
from runs.models.inbox import WebhookSource

pytestmark = pytest.mark.django_db

SECRET = "correct-horse-battery-staple-42"


def stored(source: WebhookSource) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT secret FROM {WebhookSource._meta.db_table} WHERE id = %s", [source.pk])
        return cursor.fetchone()[0]


def make_source() -> WebhookSource:
    return WebhookSource.objects.create(slug="in", name="In", agent_name="support", owner_id="jane", secret=SECRET,
                                        message_id_header="X-Message-Id")


def test_the_database_holds_no_plain_secret_and_the_app_reads_it_back():
    source = make_source()
    raw = stored(source)
    assert SECRET not in raw and raw.startswith(crypto.PREFIX)
    assert WebhookSource.objects.get(pk=source.pk).secret == SECRET
    body = b'{"hello": "world"}'
    header = signing.sign_timestamped(SECRET, body, message_id="m-1")
    assert header  # a client signs with the plain secret; the server verifies with the decrypted one


def test_keys_rotate_without_a_gap(settings):
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    settings.SECRETS_ENCRYPTION_KEYS = [old]
    source = make_source()
    before = stored(source)
    settings.SECRETS_ENCRYPTION_KEYS = [new, old]
    assert WebhookSource.objects.get(pk=source.pk).secret == SECRET  # still read with the old key
    call_command("rotate_secrets")
    after = stored(source)
    assert after != before
    settings.SECRETS_ENCRYPTION_KEYS = [new]  # the old key dropped
    assert WebhookSource.objects.get(pk=source.pk).secret == SECRET


def test_a_missing_key_is_said_plainly(settings):
    source = make_source()
    settings.SECRETS_ENCRYPTION_KEYS = [Fernet.generate_key().decode()]
    with pytest.raises(ImproperlyConfigured, match="SECRETS_ENCRYPTION_KEYS"):
        WebhookSource.objects.get(pk=source.pk)


def test_a_bad_key_stops_start_up_naming_the_variable():
    with pytest.raises(ImproperlyConfigured, match="SECRETS_ENCRYPTION_KEYS: key 2"):
        crypto.check_keys([Fernet.generate_key().decode(), "not-a-key"])


def test_the_migration_encrypts_secrets_stored_before_it():
    from importlib import import_module

    source = make_source()
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {WebhookSource._meta.db_table} SET secret = %s WHERE id = %s", [SECRET, source.pk])
    migration = import_module("runs.migrations.0014_credentials")
    from django.apps import apps

    # What the data step uses of a schema editor (SQLite's cannot open inside the test's transaction).
    editor = SimpleNamespace(connection=connection, quote_name=connection.ops.quote_name)
    migration.encrypt_secrets(apps, editor)
    assert stored(source).startswith(crypto.PREFIX)
    assert WebhookSource.objects.get(pk=source.pk).secret == SECRET
    migration.decrypt_secrets(apps, editor)
    assert stored(source) == SECRET
