"""Webhook secrets under a new encryption key: every stored secret re-encrypted under the first key."""

from __future__ import annotations

from django.db import transaction

from runs.models.inbox import WebhookSource


def rotate_webhook_secrets() -> int:
    """Re-encrypt each source's secret under SECRETS_ENCRYPTION_KEYS' first key; returns how many."""
    count = 0
    with transaction.atomic():
        for source in WebhookSource.objects.select_for_update().only("pk", "secret").order_by("pk"):
            # Read with whichever key encrypted it; written back under the first.
            WebhookSource.objects.filter(pk=source.pk).update(secret=source.secret)
            count += 1
    return count
