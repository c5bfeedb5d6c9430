from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from runs import reconcile
from runs.models import AgentRun, RunStatus, ToolCall


class ReadOnlyAdminMixin:
    """Records, not forms: nothing can be added, changed or deleted by hand."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class ToolCallInline(ReadOnlyAdminMixin, admin.TabularInline):
    model = ToolCall
    fields = ["seq", "tool_name", "call_id", "args", "status", "called_at", "answered_at", "response_summary"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["seq"]


def tools_label(run: AgentRun) -> str:
    if run.tools_executed is None:
        return "unknown"
    return ", ".join(run.tools_executed) or "none"


def retries_label(run: AgentRun) -> str:
    """The model calls retried at the boundary (rate limits, empty turns), one line each."""
    entries = run.model_retries or []
    if not entries:
        return "none"
    lines = []
    for entry in entries:
        reason = str(entry.get("reason", "?")).replace("_", " ")
        waited = f", waited {entry['waited_s']:g} s" if entry.get("waited_s") else ""
        lines.append((reason, entry.get("attempt", "?"), waited, entry.get("at", "")))
    count = f"{len(entries)} retr{'y' if len(entries) == 1 else 'ies'}"
    return format_html(
        "{}:<ul>{}</ul>",
        count,
        format_html_join("", "<li>{} (attempt {}{}) at {}</li>", lines),
    )


class StaleRunningFilter(admin.SimpleListFilter):
    """Runs still marked running whose worker has gone silent (the reconciliation rule)."""

    title = "stale running"
    parameter_name = "stale"

    def lookups(self, request, model_admin):
        return [("yes", "stale running")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return reconcile.stale_runs(queryset=queryset)
        return queryset


@admin.register(AgentRun)
class AgentRunAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = [
        "run_id",
        "status",
        "agent_name",
        "trigger",
        "owner_id",
        "tools_called",
        "attempts",
        "created_at",
        "finished_at",
        "replay_of_link",
    ]
    list_filter = ["status", "trigger", "agent_name", StaleRunningFilter]
    actions = ["reconcile_stale_runs_now"]
    search_fields = ["=run_id", "=owner_id", "error_message"]
    list_select_related = ["replay_of"]
    show_full_result_count = False
    ordering = ["-created_at"]
    inlines = [ToolCallInline]
    readonly_fields = [
        "run_id",
        "status",
        "agent_name",
        "trigger",
        "owner_id",
        "created_by",
        "config",
        "input_file_name",
        "input_file_sha256",
        "input_file_size",
        "tools_called",
        "error_code",
        "error_message",
        "result",
        "attempts",
        "replay_of_link",
        "forced",
        "forced_by",
        "force_reason",
        "session_id",
        "conversation_id",
        "created_at",
        "started_at",
        "heartbeat_at",
        "finished_at",
        "worker",
        "cancel_requested_at",
        "late_outcome",
        "late_outcome_summary",
        "requeued_at",
        "model_retries_summary",
    ]
    fieldsets = [
        (None, {"fields": ["run_id", "status", "agent_name", "trigger", "owner_id", "created_by"]}),
        ("Input", {"fields": ["config", "input_file_name", "input_file_sha256", "input_file_size"]}),
        ("Outcome", {"fields": ["tools_called", "error_code", "error_message", "result", "late_outcome_summary"]}),
        ("Replay", {"fields": ["replay_of_link", "forced", "forced_by", "force_reason"]}),
        (
            "Execution",
            {
                "fields": [
                    "attempts",
                    "worker",
                    "session_id",
                    "conversation_id",
                    "created_at",
                    "started_at",
                    "heartbeat_at",
                    "finished_at",
                    "cancel_requested_at",
                    "requeued_at",
                    "model_retries_summary",
                ]
            },
        ),
    ]

    @admin.display(description="tools called")
    def tools_called(self, run: AgentRun) -> str:
        return tools_label(run)

    @admin.display(description="model retries")
    def model_retries_summary(self, run: AgentRun) -> str:
        return retries_label(run)

    @admin.display(description="replay of", ordering="replay_of")
    def replay_of_link(self, run: AgentRun) -> str:
        if run.replay_of_id is None:
            return "—"
        url = reverse("admin:runs_agentrun_change", args=[run.replay_of_id])
        return format_html('<a href="{}">{}</a>', url, str(run.replay_of_id)[:8])

    def get_object(self, request, object_id, from_field=None):
        run = super().get_object(request, object_id, from_field)
        # Reconcile-on-read: a page never shows "running" for a run whose worker is gone.
        if run is not None and reconcile.reconcile_run_if_stale(run):
            self.message_user(
                request,
                "This run had stopped sending heartbeats and was reconciled just now: its outcome is unknown.",
                messages.WARNING,
            )
        return run

    @admin.display(description="late outcome")
    def late_outcome_summary(self, run: AgentRun) -> str:
        late = run.late_outcome
        if not late:
            return "—"
        tools = late.get("tools_executed")
        tools_text = "unknown" if tools is None else (", ".join(tools) or "none")
        detail = late.get("result") or " ".join(filter(None, [late.get("error_code"), late.get("error_message")]))
        return format_html(
            '<div style="border-left:4px solid #ba2121;padding-left:8px">'
            "<strong>The worker finished after this run had already been settled as {} ({}).</strong><br>"
            "It reported <strong>{}</strong> at {}; tools called: {}.<br>{}"
            "<br><em>The first verdict above was kept; this is what the worker saw.</em></div>",
            run.status,
            run.error_code or "no code",
            late.get("status", "?"),
            late.get("finished_at", "?"),
            tools_text,
            detail or "",
        )

    @admin.action(description="Reconcile stale runs now")
    def reconcile_stale_runs_now(self, request, queryset):
        landed = reconcile.reconcile_stale_runs(queryset=queryset)
        for run in landed:
            self.message_user(request, f"Run {run.run_id} reconciled. {run.error_message}", messages.SUCCESS)
        landed_ids = {run.pk for run in landed}
        # Bounded: with "select all" the selection can be the whole table.
        alive = (
            queryset.select_related(None)
            .filter(status=RunStatus.RUNNING)
            .exclude(pk__in=landed_ids)
            .only("run_id", "heartbeat_at")
        )
        for run in alive[:50]:
            self.message_user(
                request,
                f"Run {run.run_id} is still running and sending heartbeats"
                f"{f' (last at {run.heartbeat_at:%H:%M:%S} UTC)' if run.heartbeat_at else ''}: left alone.",
                messages.WARNING,
            )
        if not landed:
            self.message_user(request, "None of the selected runs is stale: nothing was reconciled.", messages.INFO)
