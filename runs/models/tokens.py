"""API tokens as the admin shows them: DRF's tokens, named by a prefix of their key."""

from __future__ import annotations

from rest_framework.authtoken.models import Token

from config.lib.auth import key_prefix


class ApiToken(Token):
    """DRF's Token, whose name (page titles, breadcrumbs, the admin's history) is a key prefix."""

    class Meta:
        proxy = True
        verbose_name = "API token"
        verbose_name_plural = "API tokens"

    def __str__(self) -> str:
        return f"{key_prefix(self.key)} ({self.user})"
