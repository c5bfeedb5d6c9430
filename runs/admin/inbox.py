"""The webhook inbox in the admin: sources (configured here) and events (records, with a desk).

Event actions are doors onto runs.inbox.desk like the run desk's onto runs.services.run: the same
rules, one message per event. Processing an event again is a replay of a run nobody in particular
started: “Retry now” needs `runs.replay_agentrun`, “Force reprocess…” that and the force permission;
“Mark resolved” needs `runs.resolve_webhookevent`. Saving a source for an owner needs that the
staff member may act for that owner (`runs.rules.permissions`).
"""

from __future__ import annotations

import json
from pathlib import Path

from django import forms
from django.conf import settings
from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.db.models import Prefetch
from django.http import FileResponse, Http404
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from agents.registry import runnable_agents
from config.lib.admin import (
    CappedCountPaginator,
    CheckedSelectionMixin,
    ObjectButton,
    PrimaryKeySearchMixin,
    ReadOnlyAdminMixin,
    ReasonedAction,
    act_on_each,
    back,
    confirm_with_reason,
    object_buttons,
)
from runs.admin.actions import called_tools, change_url, journal_rows
from runs.admin.owners import OwnerCheckedAdminMixin
from runs.inbox import attempts, desk, refusals
from runs.inputs import sources
from runs.models.inbox import WebhookEvent, WebhookSource
from runs.models.ledger import AgentRun
from runs.rules import permissions
from runs.rules import replay as rules
from runs.services import run as services

# --- Sources ---------------------------------------------------------------------------------------


class WebhookSourceForm(forms.ModelForm):
    agent_name = forms.ChoiceField(label="Agent", choices=())
    new_secret = forms.CharField(
        label="Shared secret",
        required=False,
        strip=False,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text=(
            f"The HMAC-SHA256 key the provider signs each delivery with (at least {sources.MIN_SECRET_CHARS} "
            "characters). It is never shown again; leave blank to keep the current one."
        ),
    )

    class Meta:
        model = WebhookSource
        # Everything but the stored secret, which is only ever written through new_secret.
        fields = ["slug", "name", "agent_name", "owner_id", "signature_scheme", "message_id_header",
                  "message_id_field", "expects_attachments", "instructions", "params", "enabled", "created_at"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        names = runnable_agents()
        current = self.instance.agent_name if self.instance.pk else ""
        if current and current not in names:
            names.append(current)  # shown so the person sees what is configured; clean() refuses it
        self.fields["agent_name"].choices = [(name, name) for name in names]
        self.fields["new_secret"].required = not (self.instance.pk and self.instance.secret)

    def clean_new_secret(self) -> str:
        secret = self.cleaned_data.get("new_secret") or ""
        if secret:
            # Set before the model's own validation (which holds the secret rule) runs on the instance.
            self.instance.secret = secret
        return secret

    def _update_errors(self, errors) -> None:
        # The model's rules report a bad secret under `secret`, which this form shows as `new_secret`.
        if hasattr(errors, "error_dict") and "secret" in errors.error_dict:
            errors.error_dict.setdefault("new_secret", []).extend(errors.error_dict.pop("secret"))
        super()._update_errors(errors)


@admin.register(WebhookSource)
class WebhookSourceAdmin(CheckedSelectionMixin, OwnerCheckedAdminMixin, admin.ModelAdmin):
    form = WebhookSourceForm
    list_display = ["slug", "name", "agent_name", "owner_id", "signature_scheme", "message_id_location",
                    "expects_attachments", "enabled", "secret_state", "endpoint"]
    list_filter = ["enabled", "signature_scheme", "agent_name"]
    search_fields = ["slug", "name"]
    readonly_fields = ["endpoint", "secret_state", "created_at"]
    fieldsets = [
        (None, {"fields": ["slug", "name", "enabled", "endpoint"]}),
        ("What runs", {"fields": ["agent_name", "owner_id", "instructions", "params"]}),
        ("Delivery", {"fields": ["new_secret", "secret_state", "signature_scheme", "message_id_header",
                                 "message_id_field", "expects_attachments"]}),
        ("Record", {"fields": ["created_at"]}),
    ]

    @admin.display(description="secret")
    def secret_state(self, source: WebhookSource) -> str:
        # Never the secret itself, not even a part of it: only whether one is set.
        return f"set ({len(source.secret)} characters)" if source.secret else "not set"

    @admin.display(description="endpoint")
    def endpoint(self, source: WebhookSource) -> str:
        return f"POST /api/webhooks/{source.slug}/" if source.slug else "—"


# --- Events ----------------------------------------------------------------------------------------


def event_label(event: WebhookEvent) -> str:
    return f"Event {event.external_id} ({str(event.event_id)[:8]})"


@admin.action(permissions=["replay"], description="Retry now")
def retry_now(modeladmin, request, queryset):
    act_on_each(
        modeladmin, request, queryset.order_by("received_at"),
        act=lambda event: desk.retry_event(event.pk, actor=request.user),
        label=event_label,
        success=lambda event, run: f"retrying as run {str(run.run_id)[:8]}.",
        refused=refusals.event_wording,
    )
    return back(request)


@admin.action(permissions=["resolve"], description="Mark resolved")
def mark_resolved(modeladmin, request, queryset):
    act_on_each(
        modeladmin, request, queryset.order_by("received_at"),
        act=lambda event: desk.resolve_event(event.pk, actor=request.user),
        label=event_label,
        success=lambda event, resolved: "marked resolved.",
        refused=refusals.event_wording,
    )
    return back(request)


def force_rows(events) -> list[dict]:
    """For each event: its last run, what that run already called, and what forcing would do."""
    rows = []
    for event in events:
        run = attempts.last_run(event)
        row = {"event": event, "url": reverse("admin:runs_webhookevent_change", args=[event.pk]), "run": run,
               "tools": None, "journal": [], "blocked": "", "overrides": ""}
        if event.status == "processing":
            row["blocked"] = refusals.EventInFlight().admin_detail
        if run is not None:
            forced = rules.decide(run, force=True)
            row.update(run_url=change_url(run), tools=called_tools(run), journal=journal_rows(run))
            if forced.refusal is not None:
                row["blocked"] = row["blocked"] or forced.refusal.admin_detail
            elif forced.overridden is not None:
                row["overrides"] = refusals.event_wording(forced.overridden)
        rows.append(row)
    return rows


FORCE_REPROCESS = ReasonedAction(
    name="force_reprocess",
    slug="force-reprocess",
    title="Force reprocess",
    question=(
        "Are you sure you want to force the selected {objects_name} to be processed again? Each is processed by a "
        "new run with the event as it was received, and the event's recorded effects are reused: an email or a note "
        "an earlier attempt recorded as done is not done again. Any other tool an earlier attempt called that acts "
        "in the world will be called again."
    ),
    submit="Yes, force reprocessing",
    row_template="admin/runs/webhookevent/force_reprocess_row.html",
    check_reason=services.check_force_reason,
    max_reason_chars=services.MAX_FORCE_REASON_CHARS,
    reason_label="Reason (recorded on each new run and in the admin log):",
)


@admin.action(permissions=["force_replay"], description="Force reprocess…")
def force_reprocess(modeladmin, request, queryset):
    """Confirm, with a reason, then process again even what the rules refuse."""
    events = list(queryset.select_related("source").order_by("received_at"))

    def perform(selected, reason):
        act_on_each(
            modeladmin, request, selected,
            act=lambda event: desk.force_reprocess_event(event.pk, actor=request.user, reason=reason),
            label=event_label,
            success=lambda event, run: (
                f"{'Force-reprocessed' if run.forced else 'Reprocessed'} as run {str(run.run_id)[:8]}."
            ),
            refused=refusals.event_wording,
        )
        return back(request)

    return confirm_with_reason(
        modeladmin, request, queryset, events,
        action=FORCE_REPROCESS,
        permitted=modeladmin.has_force_replay_permission(request),
        rows=force_rows,
        perform=perform,
    )


def _pretty(value) -> str:
    return format_html('<pre class="run-json">{}</pre>', json.dumps(value, indent=2, ensure_ascii=False))


def stored_attachment_path(entry: dict) -> Path | None:
    """A stored copy, if it exists and lies inside WEBHOOK_ATTACHMENTS_DIR (a row is never trusted blindly)."""
    root = Path(settings.WEBHOOK_ATTACHMENTS_DIR).resolve()
    path = Path(entry.get("path", "")).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        return None
    return path


@admin.register(WebhookEvent)
class WebhookEventAdmin(CheckedSelectionMixin, PrimaryKeySearchMixin, ReadOnlyAdminMixin, admin.ModelAdmin):
    """Records, not forms: the desk's actions are the only way to act on an event."""

    list_display = ["short_id", "status", "source", "external_id", "attempts", "next_attempt_at",
                    "last_error_short", "runs_links", "received_at"]
    list_display_links = ["short_id"]
    list_filter = ["status", "source"]
    search_fields = ["=external_id"]
    search_help_text = "A provider message id, or a full event id."
    list_select_related = ["source"]
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = CappedCountPaginator
    list_per_page = 50
    ordering = ["-received_at"]
    actions = [retry_now, force_reprocess, mark_resolved]
    readonly_fields = ["event_id", "status", "source", "external_id", "attempts", "received_at", "next_attempt_at",
                       "lease_expires_at", "leased_by", "finished_at", "resolved_by",
                       "last_error_text", "runs_table", "payload_pretty", "headers_pretty", "attachments_links"]
    fieldsets = [
        (None, {"fields": ["event_id", "status", "source", "external_id", "received_at"]}),
        ("Processing", {"fields": ["attempts", "last_error_text", "runs_table", "next_attempt_at",
                                   "lease_expires_at", "leased_by", "finished_at", "resolved_by"]}),
        ("Delivery", {"fields": ["payload_pretty", "headers_pretty", "attachments_links"]}),
    ]

    def has_view_permission(self, request, obj=None):
        # Whoever may review runs may review the events that start them.
        return super().has_view_permission(request, obj) or request.user.has_perm("runs.view_agentrun")

    def has_force_replay_permission(self, request, obj=None):
        return permissions.may_force_replay(user=request.user) and permissions.may_replay_others(user=request.user)

    def has_replay_permission(self, request, obj=None):
        return permissions.may_replay_others(user=request.user)

    def has_resolve_permission(self, request, obj=None):
        return permissions.may_resolve_events(user=request.user)

    def get_queryset(self, request):
        runs = AgentRun.objects.only("run_id", "status", "created_at", "webhook_event_id", "tools_executed",
                                     "error_code").order_by("created_at")
        return super().get_queryset(request).prefetch_related(Prefetch("runs", queryset=runs))

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        custom = [
            path(
                "<path:object_id>/attachment/<int:index>/",
                self.admin_site.admin_view(self.attachment_view),
                name="%s_%s_attachment" % info,
            ),
        ]
        return custom + super().get_urls()

    def attachment_view(self, request, object_id, index):
        event = self.get_object(request, unquote(object_id))
        if event is None or not self.has_view_permission(request, event):
            raise Http404("No such event.")
        try:
            entry = event.attachments[index]
        except (IndexError, TypeError):
            raise Http404("This event has no such attachment.") from None
        stored = stored_attachment_path(entry)
        if stored is None:
            raise Http404("The stored copy of this attachment is gone from disk.")
        return FileResponse(stored.open("rb"), as_attachment=True, filename=entry["filename"])

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra_context = dict(extra_context or {})
        buttons = []
        if self.has_replay_permission(request):
            buttons.append(ObjectButton("retry_now", "Retry now", "retry_now-button"))
        if self.has_force_replay_permission(request):
            buttons.append(ObjectButton("force_reprocess", "Force reprocess…", "force_reprocess-button"))
        if self.has_resolve_permission(request):
            buttons.append(ObjectButton("mark_resolved", "Mark resolved", "mark_resolved-button"))
        extra_context.update(object_buttons(self, buttons))
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="event", ordering="event_id")
    def short_id(self, event: WebhookEvent) -> str:
        return str(event.event_id)[:8]

    @admin.display(description="last error")
    def last_error_short(self, event: WebhookEvent) -> str:
        text = event.last_error or "—"
        return text if len(text) <= 140 else text[:139] + "…"

    @admin.display(description="last error")
    def last_error_text(self, event: WebhookEvent) -> str:
        return format_html('<div class="run-message">{}</div>', event.last_error or "—")

    @admin.display(description="runs")
    def runs_links(self, event: WebhookEvent) -> str:
        runs = list(event.runs.all())
        if not runs:
            return "—"
        return format_html_join(
            ", ", '<a href="{}">{} ({})</a>',
            ((change_url(run), str(run.run_id)[:8], run.status) for run in runs),
        )

    @admin.display(description="runs (attempts)")
    def runs_table(self, event: WebhookEvent) -> str:
        runs = list(event.runs.all())
        if not runs:
            return "none yet"
        rows = []
        for number, run in enumerate(runs, start=1):
            tools = "unknown" if run.tools_executed is None else (", ".join(run.tools_executed) or "none")
            rows.append((number, change_url(run), str(run.run_id)[:8], run.status,
                         run.error_code or "—", tools, f"{run.created_at:%Y-%m-%d %H:%M:%S}"))
        return format_html(
            "<table><thead><tr><th>#</th><th>run</th><th>status</th><th>error</th><th>tools called</th>"
            "<th>started</th></tr></thead><tbody>{}</tbody></table>",
            format_html_join("", '<tr><td>{}</td><td><a href="{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td>'
                                 "<td>{}</td></tr>", rows),
        )

    @admin.display(description="payload")
    def payload_pretty(self, event: WebhookEvent) -> str:
        return _pretty(event.payload)

    @admin.display(description="headers")
    def headers_pretty(self, event: WebhookEvent) -> str:
        return _pretty(event.headers) if event.headers else "—"

    @admin.display(description="attachments")
    def attachments_links(self, event: WebhookEvent) -> str:
        if not event.attachments:
            return "—"
        items = []
        for index, entry in enumerate(event.attachments):
            if stored_attachment_path(entry) is None:
                items.append(format_html("<li>“{}” ({} bytes) — the stored copy is gone from disk</li>",
                                         entry["filename"], entry["size"]))
                continue
            url = reverse("admin:runs_webhookevent_attachment", args=[event.pk, index])
            items.append(format_html('<li><a href="{}">{}</a> ({}, {} bytes)</li>', url, entry["filename"],
                                     entry["content_type"], entry["size"]))
        return format_html("<ul>{}</ul>", format_html_join("", "{}", ((item,) for item in items)))
