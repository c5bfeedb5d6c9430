import json
import uuid
from collections import Counter

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.db.models import OuterRef, Subquery
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from runs import desk, reconcile, timeline
from runs import scheduling
from runs import webhook_admin  # noqa: F401 - registers the webhook inbox
from runs.models import AgentRun, RunSchedule, RunStatus, ScheduleFiring, ToolCall


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
    verbose_name = "tool call"
    verbose_name_plural = "tool journal"
    fields = ["seq", "tool_name", "call_id", "args", "status", "doubt", "called_at", "answered_at", "response_summary"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["seq"]

    @admin.display(description="in doubt")
    def doubt(self, call: ToolCall) -> str:
        return "yes: called, never answered" if call.in_doubt else ""


def tools_label(run: AgentRun) -> str:
    """unknown / none / each tool once in first-call order, with a count when called repeatedly."""
    if run.tools_executed is None:
        return "unknown"
    counts = Counter(run.tools_executed)
    return ", ".join(
        name if counts[name] == 1 else f"{name} ×{counts[name]}" for name in dict.fromkeys(run.tools_executed)
    ) or "none"


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


def _pretty_json(value) -> str:
    return format_html('<pre class="run-json">{}</pre>', json.dumps(value, indent=2, ensure_ascii=False))


def workflow_steps_context(run: AgentRun) -> dict:
    """A workflow run's graph coloured by step status, and its steps as bars on one time axis."""
    if not run.workflow:
        return {}
    from agents.workflow_html import GRAPH_CSS, render_graph

    steps = list(run.steps.order_by("seq"))
    top_level = {step.step_name: step.status for step in steps if step.depth == 0}
    origin = min((step.started_at for step in steps), default=None)
    end = max((step.finished_at or run.finished_at or timezone.now() for step in steps), default=None)
    span = max((end - origin).total_seconds(), 0.001) if origin and end else 1.0
    rows = []
    for step in steps:
        finished = step.finished_at or run.finished_at or timezone.now()
        left = (step.started_at - origin).total_seconds() / span * 100 if origin else 0
        width = max((finished - step.started_at).total_seconds() / span * 100, 0.5)
        rows.append({"step": step, "left": f"{left:.2f}", "width": f"{min(width, 100 - left):.2f}",
                     "indent": step.depth * 1.2})
    return {
        "step_graph": render_graph(run.workflow["graph"], top_level),
        "step_graph_css": GRAPH_CSS,
        "step_rows": rows,
        "workflow_name": run.workflow.get("name", run.agent_name),
    }


@admin.register(AgentRun)
class AgentRunAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    change_form_template = "admin/runs/agentrun/change_form.html"
    list_display = [
        "short_id",
        "status",
        "agent_name",
        "trigger",
        "owner_id",
        "tools_called",
        "attempts",
        "created_at",
        "duration",
        "replay_of_link",
        "latest_replay_link",
    ]
    list_display_links = ["short_id"]
    list_filter = ["status", "trigger", desk.AgentFilter, desk.ToolsStateFilter, StaleRunningFilter]
    search_fields = ["=run_id", "=owner_id", "=error_code", "error_message"]
    search_help_text = "A full run id, an owner id, an error code, or words from the error message."
    list_select_related = ["replay_of"]
    show_full_result_count = False
    # Facet counts are one COUNT per filter choice: too slow on a table of millions of runs.
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 50
    paginator = desk.CappedCountPaginator
    ordering = ["-created_at"]
    inlines = [ToolCallInline]
    actions = [desk.replay_selected, desk.force_replay_selected, desk.cancel_selected, "reconcile_stale_runs_now"]
    readonly_fields = [
        "run_id",
        "status",
        "agent_name",
        "trigger",
        "owner_id",
        "created_by",
        "input_message",
        "input_params",
        "input_file_link",
        "input_file_sha256",
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
        "cancel_requested_by",
        "late_outcome_summary",
        "requeued_at",
        "model_retries_summary",
    ]
    fieldsets = [
        (None, {"fields": ["run_id", "status", "agent_name", "trigger", "owner_id", "created_by"]}),
        ("Input", {"fields": ["input_message", "input_params", "input_file_link", "input_file_sha256"]}),
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
                    "cancel_requested_by",
                    "requeued_at",
                    "model_retries_summary",
                ]
            },
        ),
    ]

    def get_queryset(self, request):
        latest_replay = AgentRun.objects.filter(replay_of=OuterRef("pk")).order_by("-created_at").values("pk")[:1]
        return super().get_queryset(request).annotate(latest_replay_id=Subquery(latest_replay))

    def get_search_results(self, request, queryset, search_term):
        # A run id is the most common search and has its own index: don't scan error texts for it.
        try:
            run_id = uuid.UUID(search_term.strip())
        except ValueError:
            return super().get_search_results(request, queryset, search_term)
        return queryset.filter(run_id=run_id), False

    def has_force_replay_permission(self, request, obj=None):
        return request.user.has_perm("runs.force_replay_agentrun")

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        custom = [
            path(
                "<path:object_id>/input-file/",
                self.admin_site.admin_view(lambda request, object_id: desk.input_file_view(self, request, object_id)),
                name="%s_%s_input_file" % info,
            ),
        ]
        return custom + super().get_urls()

    def change_view(self, request, object_id, form_url="", extra_context=None):
        run = self.get_object(request, unquote(object_id))
        extra_context = dict(extra_context or {})
        if run is not None and self.has_view_permission(request, run):
            extra_context.update(
                timeline=timeline.timeline_items(timeline.run_events(run)),
                replay_chain=desk.replay_chain(run),
                decision=desk.decision_now(run),
                can_force=self.has_force_replay_permission(request),
                changelist_url=reverse("admin:runs_agentrun_changelist"),
                action_checkbox_name=helpers.ACTION_CHECKBOX_NAME,
                **workflow_steps_context(run),
            )
        return super().change_view(request, object_id, form_url, extra_context)

    # --- Columns and fields ---

    @admin.display(description="run", ordering="run_id")
    def short_id(self, run: AgentRun) -> str:
        return str(run.run_id)[:8]

    @admin.display(description="tools called")
    def tools_called(self, run: AgentRun) -> str:
        return tools_label(run)

    @admin.display(description="model retries")
    def model_retries_summary(self, run: AgentRun) -> str:
        return retries_label(run)

    @admin.display(description="took")
    def duration(self, run: AgentRun) -> str:
        if run.started_at is None or run.finished_at is None:
            return "—"
        seconds = (run.finished_at - run.started_at).total_seconds()
        return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"

    @admin.display(description="replay of", ordering="replay_of")
    def replay_of_link(self, run: AgentRun) -> str:
        if run.replay_of_id is None:
            return "—"
        url = reverse("admin:runs_agentrun_change", args=[run.replay_of_id])
        label = str(run.replay_of_id)[:8]
        if "replay_of" in run._state.fields_cache and run.replay_of is not None:
            label = f"{label} ({run.replay_of.status})"
        return format_html('<a href="{}">{}</a>', url, label)

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

    @admin.display(description="latest replay")
    def latest_replay_link(self, run: AgentRun) -> str:
        replay_id = getattr(run, "latest_replay_id", None)
        if replay_id is None:
            return "—"
        url = reverse("admin:runs_agentrun_change", args=[replay_id])
        return format_html('<a href="{}">{}</a>', url, str(replay_id)[:8])

    @admin.display(description="message")
    def input_message(self, run: AgentRun) -> str:
        return format_html('<div class="run-message">{}</div>', run.message)

    @admin.display(description="params")
    def input_params(self, run: AgentRun) -> str:
        return _pretty_json(run.params) if run.params else "—"

    @admin.display(description="input file")
    def input_file_link(self, run: AgentRun) -> str:
        if not run.input_file:
            return "—"
        size = f"{run.input_file_size} bytes" if run.input_file_size is not None else "size unknown"
        if desk.stored_input_path(run) is None:
            return format_html("“{}” ({}) — the stored copy is gone from disk", run.input_file_name, size)
        url = reverse("admin:runs_agentrun_input_file", args=[run.run_id])
        return format_html('<a href="{}">{}</a> ({})', url, run.input_file_name, size)


# --- Scheduled runs --------------------------------------------------------------------------------


class ScheduleFiringInline(ReadOnlyAdminMixin, admin.TabularInline):
    model = ScheduleFiring
    verbose_name_plural = "firings (newest first)"
    fields = ["slot", "fired_at", "outcome", "run_link", "blocking_run_link", "detail"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["-slot"]
    max_num = 0

    def get_queryset(self, request):
        return super().get_queryset(request).order_by("-slot")

    @admin.display(description="run")
    def run_link(self, firing: ScheduleFiring) -> str:
        return _run_link(firing.run_id)

    @admin.display(description="blocked by")
    def blocking_run_link(self, firing: ScheduleFiring) -> str:
        return _run_link(firing.blocking_run_id)


def _run_link(run_id) -> str:
    if run_id is None:
        return "—"
    return format_html('<a href="{}">{}</a>', reverse("admin:runs_agentrun_change", args=[run_id]), str(run_id)[:8])


@admin.register(RunSchedule)
class RunScheduleAdmin(admin.ModelAdmin):
    """Staff schedule an agent or a workflow; each firing is a run with trigger `schedule`."""

    list_display = ["name", "enabled", "agent_name", "timing", "next_fire_at", "last_fired_at", "last_run_link",
                    "last_skipped_at"]
    list_filter = ["enabled", "kind"]
    search_fields = ["name", "agent_name", "owner_id"]
    inlines = [ScheduleFiringInline]
    readonly_fields = ["next_fire_at", "last_fired_at", "last_run_link", "last_skipped_at", "last_skip_reason",
                       "created_by", "created_at"]
    fieldsets = [
        (None, {"fields": ["name", "enabled"]}),
        ("What runs", {"fields": ["agent_name", "message", "owner_id", "params"],
                       "description": "A registered agent or a workflow, and the input each run gets."}),
        ("When", {"fields": ["kind", "interval_minutes", "cron", "next_fire_at"],
                  "description": "Checked every minute. A firing while the previous run of this schedule is "
                                 "still queued or running is skipped and recorded below."}),
        ("History", {"fields": ["last_fired_at", "last_run_link", "last_skipped_at", "last_skip_reason",
                                "created_by", "created_at"]}),
    ]

    @admin.display(description="when")
    def timing(self, schedule: RunSchedule) -> str:
        if schedule.kind == "cron":
            return f"cron {schedule.cron}"
        return f"every {schedule.interval_minutes} min"

    @admin.display(description="last run")
    def last_run_link(self, schedule: RunSchedule) -> str:
        return _run_link(schedule.last_run_id)

    def save_model(self, request, obj, form, change):
        if not change:
            obj.created_by = request.user
        timing = {"kind", "interval_minutes", "cron", "enabled"}
        scheduling.prepare_for_save(obj, timing_changed=not change or bool(timing & set(form.changed_data)))
        super().save_model(request, obj, form, change)
