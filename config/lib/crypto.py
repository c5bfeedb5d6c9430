"""Secrets the application must read back (webhook sources' shared secrets), encrypted at rest.

A webhook secret is an HMAC key both sides hold, so it cannot be hashed like a password: it is
stored encrypted with Fernet (the `cryptography` package: AES-128-CBC with an HMAC-SHA256, and
a timestamp) under the keys in SECRETS_ENCRYPTION_KEYS. MultiFernet encrypts with the first key
and decrypts with any of them, so keys rotate without a gap: put the new key first, keep the old
ones after it, run `manage.py rotate_secrets` (which re-encrypts every stored secret under the
first key), then drop the old ones. A database dump or a copied SQLite file alone no longer
gives away any source's secret.
"""

from __future__ import annotations

import base64
import functools
import hashlib

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import models

PREFIX = "fernet:"


def derived_key(secret_key: str) -> str:
    """A Fernet key derived from SECRET_KEY: the default when SECRETS_ENCRYPTION_KEYS is unset."""
    digest = hashlib.sha256(b"agent-ledger secrets encryption\x00" + secret_key.encode()).digest()
    return base64.urlsafe_b64encode(digest).decode()


def check_keys(keys: list[str]) -> list[str]:
    """Each key as Fernet reads it (32 url-safe base64 bytes), or ImproperlyConfigured naming the variable."""
    for position, key in enumerate(keys, start=1):
        try:
            Fernet(key)
        except (ValueError, TypeError):
            raise ImproperlyConfigured(
                f"SECRETS_ENCRYPTION_KEYS: key {position} is not a Fernet key (32 url-safe base64-encoded "
                "bytes; make one with `python -c 'from cryptography.fernet import Fernet; "
                "print(Fernet.generate_key().decode())'`)."
            ) from None
    return keys


@functools.lru_cache(maxsize=4)
def _multi(keys: tuple[str, ...]) -> MultiFernet:
    return MultiFernet([Fernet(key) for key in keys])


def _fernet() -> MultiFernet:
    return _multi(tuple(settings.SECRETS_ENCRYPTION_KEYS))


def encrypt(text: str) -> str:
    return PREFIX + _fernet().encrypt(text.encode()).decode()


def decrypt(stored: str) -> str:
    if not stored.startswith(PREFIX):
        return stored  # written before encryption; the migration encrypts every such row
    try:
        return _fernet().decrypt(stored[len(PREFIX):].encode()).decode()
    except InvalidToken:
        raise ImproperlyConfigured(
            "A stored secret cannot be decrypted with any key in SECRETS_ENCRYPTION_KEYS: was a key "
            "dropped before `manage.py rotate_secrets` ran, or SECRET_KEY changed while no key was set?"
        ) from None


def rotated(stored: str) -> str:
    """`stored` encrypted again under the first key (plain text is encrypted)."""
    if not stored.startswith(PREFIX):
        return encrypt(stored) if stored else stored
    return PREFIX + _fernet().rotate(stored[len(PREFIX):].encode()).decode()


class EncryptedTextField(models.TextField):
    """Text the application reads back, stored encrypted (Fernet). It cannot be filtered on."""

    def from_db_value(self, value, expression, connection):
        return value if value is None or value == "" else decrypt(value)

    def get_prep_value(self, value):
        value = super().get_prep_value(value)
        return value if value is None or value == "" else encrypt(value)
