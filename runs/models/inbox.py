"""The durable webhook inbox: sources allowed to post, and the events they delivered."""

import uuid

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxLengthValidator
from django.db import models
from django.utils import timezone

from config.lib.crypto import EncryptedTextField
from runs.inputs.sources import SignatureScheme, source_errors


class WebhookSource(models.Model):
    """A provider allowed to post events to `/api/webhooks/<slug>/`, and what runs for each event."""

    slug = models.SlugField(max_length=64, unique=True, help_text="The last part of the URL: /api/webhooks/<slug>/.")
    name = models.CharField(max_length=200)
    agent_name = models.CharField(max_length=128, help_text="The registered agent that processes each event.")
    owner_id = models.CharField(max_length=128, help_text="The end user the runs act for.")
    # A shared secret: the HMAC key both sides hold, so it must be read back; stored encrypted
    # (config/lib/crypto.py), never shown back, never logged, never returned by the API.
    secret = EncryptedTextField(validators=[MaxLengthValidator(255)])
    message_id_header = models.CharField(
        max_length=128, blank=True, help_text="The header carrying the provider's message id, e.g. X-Message-Id."
    )
    message_id_field = models.CharField(
        max_length=255, blank=True, help_text="Or the JSON field carrying it, as a dotted path, e.g. message.id."
    )
    signature_scheme = models.CharField(
        max_length=16,
        choices=SignatureScheme.choices,
        default=SignatureScheme.TIMESTAMPED,
        help_text="What the provider signs: a time, the message id and the body (timestamped), or the body "
        "alone, allowed only when the message id is a field of that body.",
    )
    expects_attachments = models.BooleanField(
        default=False,
        help_text="Deliveries may carry files in `attachments`; they are copied to disk at receipt. "
        "When off, a delivery with attachments is refused.",
    )
    instructions = models.TextField(
        blank=True, help_text="What the agent should do with each event; the event's JSON follows it."
    )
    params = models.JSONField(default=dict, blank=True, help_text="Run params, e.g. a script for the offline model.")
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "webhook_sources"
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(message_id_header="") & ~models.Q(message_id_field=""))
                | (~models.Q(message_id_header="") & models.Q(message_id_field="")),
                name="webhooksource_one_message_id_location",
            ),
            # The body-only scheme signs no header, so its message id must be inside the signed body.
            models.CheckConstraint(
                condition=models.Q(signature_scheme=SignatureScheme.TIMESTAMPED)
                | (
                    models.Q(signature_scheme=SignatureScheme.BODY)
                    & models.Q(message_id_header="")
                    & ~models.Q(message_id_field="")
                ),
                name="webhooksource_body_signature_signs_message_id",
            ),
        ]

    def __str__(self) -> str:
        return self.name or self.slug

    def clean(self) -> None:
        errors = source_errors(self)
        if errors:
            raise ValidationError(errors)

    @property
    def message_id_location(self) -> str:
        if self.message_id_header:
            return f"header {self.message_id_header}"
        return f"JSON field {self.message_id_field}"


class EventStatus(models.TextChoices):
    RECEIVED = "received", "received"
    PROCESSING = "processing", "processing"
    RETRY_WAIT = "retry_wait", "waiting to retry"
    NEEDS_REVIEW = "needs_review", "needs review"
    DEAD = "dead", "dead"
    DONE = "done", "done"
    RESOLVED = "resolved", "resolved"


class WebhookEvent(models.Model):
    """One delivery of the durable inbox, stored once per (source, provider message id).

    Its payload, a subset of its headers and copies of its attachments are written before the
    provider is answered. Each attempt to process it is a run (`runs`), started only when the
    previous one is settled and the replay rules allow it.
    """

    event_id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    source = models.ForeignKey(WebhookSource, on_delete=models.PROTECT, related_name="events")
    external_id = models.CharField(max_length=255, help_text="The provider's message id.")
    payload = models.JSONField(help_text="The delivered JSON, without the attachments' contents.")
    headers = models.JSONField(default=dict, blank=True)
    attachments = models.JSONField(
        default=list, blank=True, help_text="The stored copies: filename, content_type, size, sha256, path."
    )
    status = models.CharField(max_length=16, choices=EventStatus.choices, default=EventStatus.RECEIVED)
    attempts = models.PositiveIntegerField(default=0, help_text="Runs started for this event.")
    received_at = models.DateTimeField(default=timezone.now)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    leased_by = models.CharField(max_length=255, blank=True)
    last_error = models.TextField(blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        db_table = "webhook_events"
        ordering = ["-received_at"]
        constraints = [
            models.UniqueConstraint(fields=["source", "external_id"], name="webhookevent_source_external_id"),
        ]
        indexes = [
            models.Index(fields=["status", "next_attempt_at"], name="webhookevent_status_next"),
            models.Index(fields=["status", "lease_expires_at"], name="webhookevent_status_lease"),
            models.Index(fields=["-received_at"], name="webhookevent_received_desc"),
        ]
        # Closing an event for good is a decision of its own; retrying it is a replay (runs.replay_agentrun).
        permissions = [("resolve_webhookevent", "Can mark a webhook event resolved")]

    def __str__(self) -> str:
        return f"event {self.external_id}"
