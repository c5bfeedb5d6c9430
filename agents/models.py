from datetime import UTC, datetime

from django.conf import settings
from django.db import models
from django.utils import timezone


class Customer(models.Model):
    """The demo's customer directory, read by `lookup_customer`."""

    email = models.EmailField(unique=True)
    name = models.CharField(max_length=200)
    contact_id = models.CharField(max_length=64, unique=True)
    plan = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["email"]

    def __str__(self) -> str:
        return f"{self.name} <{self.email}>"


class OutboxEmail(models.Model):
    """Every email `send_email` sent: a repeated side effect shows up here as a second row."""

    run_id = models.UUIDField(null=True, blank=True, db_index=True)
    call_id = models.CharField(max_length=128, blank=True)
    to = models.CharField(max_length=320)
    subject = models.CharField(max_length=500)
    body = models.TextField()
    sent_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-sent_at"]
        verbose_name = "outbox email"

    def __str__(self) -> str:
        return f"to {self.to}: {self.subject}"


class CrmNote(models.Model):
    """Notes `update_crm` appended to a contact."""

    run_id = models.UUIDField(null=True, blank=True, db_index=True)
    call_id = models.CharField(max_length=128, blank=True)
    contact_id = models.CharField(max_length=64, db_index=True)
    note = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "CRM note"

    def __str__(self) -> str:
        return f"{self.contact_id}: {self.note[:60]}"


class Refund(models.Model):
    """Every refund `issue_refund` issued: money sent twice shows up here as a second row."""

    run_id = models.UUIDField(null=True, blank=True, db_index=True)
    call_id = models.CharField(max_length=128, blank=True)
    order_id = models.CharField(max_length=64, db_index=True)
    amount_cents = models.PositiveIntegerField()
    issued_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-issued_at"]

    def __str__(self) -> str:
        return f"{self.order_id}: {self.amount_cents / 100:.2f}"


class NaiveUTCDateTimeField(models.DateTimeField):
    """ADK stores naive UTC timestamps; present them as aware datetimes to Django."""

    def from_db_value(self, value, expression, connection):
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        if value is not None and timezone.is_naive(value):
            value = value.replace(tzinfo=UTC)
        return value

    def get_db_prep_value(self, value, connection, prepared=False):
        if not prepared:
            value = self.get_prep_value(value)
        if isinstance(value, datetime) and timezone.is_aware(value):
            value = value.astimezone(UTC).replace(tzinfo=None)
        # Already prepared: the parent would otherwise warn about the naive UTC value.
        return super().get_db_prep_value(value, connection, prepared=True)


class AdkSession(models.Model):
    """ADK's `sessions` table, read-only. ADK owns the table and its schema.

    ADK's key is (app_name, user_id, id); Agent Ledger always creates session ids as UUIDs,
    so `id` alone identifies a row for Django's purposes.
    """

    id = models.CharField(max_length=128, primary_key=True)
    app_name = models.CharField(max_length=128)
    user_id = models.CharField(max_length=128)
    state = models.JSONField(default=dict)
    create_time = NaiveUTCDateTimeField()
    update_time = NaiveUTCDateTimeField()

    class Meta:
        managed = False
        db_table = "sessions"
        verbose_name = "ADK session"
        ordering = ["-update_time"]

    def __str__(self) -> str:
        return f"{self.app_name}/{self.user_id}/{self.id}"


class AdkEventQuerySet(models.QuerySet):
    def of_session(self, *, app_name: str, user_id: str, session_id: str) -> "AdkEventQuerySet":
        """A session's events, oldest first (ties in the order they were stored)."""
        return self.filter(app_name=app_name, user_id=user_id, session_id=session_id).order_by("timestamp", "id")

    def of_invocation(self, *, app_name: str, user_id: str, session_id: str, invocation_id: str) -> "AdkEventQuerySet":
        """One invocation's events (a run's: a chat's session holds other runs' too), oldest first."""
        return self.of_session(app_name=app_name, user_id=user_id, session_id=session_id).filter(
            invocation_id=invocation_id
        )


class AdkEvent(models.Model):
    """ADK's `events` table, read-only: the session history as ADK wrote it."""

    id = models.CharField(max_length=128, primary_key=True)
    app_name = models.CharField(max_length=128)
    user_id = models.CharField(max_length=128)
    session_id = models.CharField(max_length=128)
    invocation_id = models.CharField(max_length=256)
    timestamp = NaiveUTCDateTimeField()
    event_data = models.JSONField(null=True)

    objects = AdkEventQuerySet.as_manager()

    class Meta:
        managed = False
        db_table = "events"
        verbose_name = "ADK event"
        ordering = ["timestamp"]

    def __str__(self) -> str:
        return f"{self.author} @ {self.timestamp:%Y-%m-%d %H:%M:%S}"

    @property
    def data(self) -> dict:
        return self.event_data or {}

    @property
    def author(self) -> str:
        return self.data.get("author", "")

    @property
    def parts(self) -> list[dict]:
        return (self.data.get("content") or {}).get("parts") or []

    @property
    def function_calls(self) -> list[dict]:
        return [p["function_call"] for p in self.parts if p.get("function_call")]

    @property
    def function_responses(self) -> list[dict]:
        return [p["function_response"] for p in self.parts if p.get("function_response")]


class WorkflowDefinition(models.Model):
    """A graph of registered agents and function steps that runs as one run (see agents.workflows).

    Staff edit it in the admin; `agents.services.check_workflow` validates it for every door.
    A run stores a snapshot of the graph, so editing a definition never changes a run that was
    already written down, or its replay.
    """

    name = models.CharField(
        max_length=64,
        unique=True,
        help_text="Letters, digits and underscores; runs name the workflow by it (the API's `agent` or `workflow`).",
    )
    description = models.TextField(blank=True)
    graph = models.JSONField(
        help_text=(
            'Steps and chains, e.g. {"steps": {"triage": {"agent": "triage"}, "billing": {"agent": "billing"}, '
            '"findings": {"join": true}, "support": {"agent": "support"}}, '
            '"chains": [["START", ["triage", "billing"], "findings", "support"]]}'
        )
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+", editable=False
    )

    class Meta:
        db_table = "workflow_definitions"
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        from agents.services import check_workflow

        self.name, self.graph = check_workflow(name=self.name, graph=self.graph, instance_pk=self.pk)


class AgentPackage(models.Model):
    """No table: the agent packages live in AGENTS_DIR. Here for its permission.

    `configure_agents` is the right to see what a package's tools are made of (MCP command lines
    and URLs, paths, the text of load errors); everyone else sees them redacted
    (agents.redaction), since a command line or a URL can carry a secret.
    """

    class Meta:
        managed = False
        default_permissions = ()
        permissions = [
            ("configure_agents", "Can configure agents (see MCP command lines, URLs and paths unredacted)"),
        ]
