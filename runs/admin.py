from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from runs.models import AgentRun, ToolCall


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
    list_filter = ["status", "trigger", "agent_name"]
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
        "model_retries_summary",
    ]
    fieldsets = [
        (None, {"fields": ["run_id", "status", "agent_name", "trigger", "owner_id", "created_by"]}),
        ("Input", {"fields": ["config", "input_file_name", "input_file_sha256", "input_file_size"]}),
        ("Outcome", {"fields": ["tools_called", "error_code", "error_message", "result", "late_outcome"]}),
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
