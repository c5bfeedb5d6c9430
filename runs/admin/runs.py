"""The run ledger in the admin: the run list and the run page (records, never forms)."""

import json

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.db.models import OuterRef, Subquery
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from agents import services as agent_services
from config.lib.admin import (
    CappedCountPaginator,
    CheckedSelectionMixin,
    PrimaryKeySearchMixin,
    ReadOnlyAdminMixin,
    object_buttons,
)
from runs.admin import actions, approvals, live, run_page, settle
from runs.admin.filters import AgentFilter, DeskFilter, StaleRunningFilter, ToolsStateFilter
from runs.admin.resume import resume_selected
from runs.ledger import reconcile, timeline
from runs.models.ledger import UNSETTLED, AgentRun, ToolCall
from runs.rules import call_states, permissions, resume
from runs.templatetags import ledger


class ToolCallInline(ReadOnlyAdminMixin, admin.TabularInline):
    model = ToolCall
    verbose_name = "tool call"
    verbose_name_plural = "tool journal"
    # Few columns, each wide enough for its words: the call id and agent sit under the tool's name.
    fields = ["seq", "tool", "arguments", "effect_class", "state", "called", "answer", "settlement"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["seq"]

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("run")

    @admin.display(description="tool")
    def tool(self, call: ToolCall) -> str:
        agent = f"by {call.agent_name} · " if call.agent_name else ""
        return format_html('<strong>{}</strong><div class="help">{}{}</div>', call.tool_name, agent, call.call_id)

    @admin.display(description="arguments")
    def arguments(self, call: ToolCall) -> str:
        return format_html('<code class="call-data">{}</code>', json.dumps(call.args, ensure_ascii=False))

    @admin.display(description="answer")
    def answer(self, call: ToolCall) -> str:
        return format_html('<code class="call-data">{}</code>', call.response_summary) if call.response_summary else "—"

    @admin.display(description="state")
    def state(self, call: ToolCall) -> str:
        # runs.rules.call_states: the same words the API's `state` and the run list say.
        state = call_states.states_of(call.run, [call])[call.call_id]
        return ledger.badge(state.label, state.tone)

    @admin.display(description="called")
    def called(self, call: ToolCall) -> str:
        return ledger.when(call.called_at)

    @admin.display(description="effect")
    def effect_class(self, call: ToolCall) -> str:
        if not call.effect:
            return "effectful (not known at call time)"
        # Why, when the tool as loaded now still has the class it had at call time (an MCP hint
        # ignored because its server is not trusted, a declaration, ADK's own tool…).
        now = agent_services.tool_effect_now(agent=call.run.agent_name, agent_node=call.agent_name, tool=call.tool_name)
        if now is not None and now.effect == call.effect and now.effect_reason:
            return f"{call.effect} — {now.effect_reason}"
        return call.effect

    @admin.display(description="settled")
    def settlement(self, call: ToolCall) -> str:
        if not call.settled_outcome:
            return ""
        who = call.settled_by.get_username() if call.settled_by else "?"
        return f"{call.get_settled_outcome_display()} — {who}, {ledger.when(call.settled_at)}: {call.settle_note}"


@admin.register(AgentRun)
class AgentRunAdmin(CheckedSelectionMixin, PrimaryKeySearchMixin, ReadOnlyAdminMixin, admin.ModelAdmin):
    change_form_template = "admin/runs/agentrun/change_form.html"
    list_display = [
        "short_id",
        "status_badge",
        "agent_name",
        "trigger",
        "owner_id",
        "tools_called",
        "created",
        "duration",
        "error_code_label",
        "lineage",
    ]
    list_display_links = ["short_id"]
    list_filter = ["status", "trigger", "recovery", AgentFilter, ToolsStateFilter, StaleRunningFilter, DeskFilter]
    search_fields = ["=run_id", "=owner_id", "=error_code", "error_message"]
    search_help_text = "A full run id, an owner id, an error code, or words from the error message."
    list_select_related = ["replay_of"]
    show_full_result_count = False
    # Facet counts are one COUNT per filter choice: too slow on a table of millions of runs.
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 50
    paginator = CappedCountPaginator
    ordering = ["-created_at"]
    inlines = [ToolCallInline]

    class Media:
        css = {"all": ["runs/ledger.css"]}
    actions = [actions.replay_selected, actions.force_replay_selected, actions.cancel_selected,
               actions.reconcile_stale_runs_now, resume_selected]
    fieldsets = [
        (None, {"fields": ["run_id", "status", "agent_name", "trigger", "owner_id", "created_by"]}),
        ("Input", {"fields": ["input_message", "input_params", "input_file_link", "input_file_sha256"]}),
        ("Outcome", {"fields": ["tools_called", "error_code", "error_message", "result", "late_outcome_summary",
                                "recovery", "recovery_detail"]}),
        ("Replay", {"fields": ["replay_of_link", "forced", "forced_by", "force_reason"]}),
        ("Resume", {"fields": ["resume_of_link", "resume_reason", "resumes_links", "agent_fingerprint"]}),
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
                    "model_retries_summary",
                    "trace_id",
                ]
            },
        ),
    ]

    # A record, not a form: every field on the page is read-only.
    readonly_fields = [name for _, options in fieldsets for name in options["fields"]]

    def get_queryset(self, request):
        latest_replay = AgentRun.objects.filter(replay_of=OuterRef("pk")).order_by("-created_at").values("pk")[:1]
        latest_resume = AgentRun.objects.filter(resume_of=OuterRef("pk")).order_by("-created_at").values("pk")[:1]
        return super().get_queryset(request).annotate(latest_replay_id=Subquery(latest_replay),
                                                      latest_resume_id=Subquery(latest_resume))

    def changelist_view(self, request, extra_context=None):
        # The list's eleven columns and its filters need the width the navigation sidebar would take
        # (the breadcrumbs still lead back): at 1400 px every column shows, none behind a scroll bar.
        return super().changelist_view(request, {"is_nav_sidebar_enabled": False, **(extra_context or {})})

    def has_force_replay_permission(self, request, obj=None):
        return permissions.may_force_replay(user=request.user)

    # The actions' gates ask what the API asks (runs.rules.permissions); each run is still checked by
    # the service, so someone else's run without the permission is refused on its own line.
    def has_replay_permission(self, request, obj=None):
        user = request.user
        if obj is not None:
            return permissions.is_own_run(actor=user, run=obj) or permissions.may_replay_others(user=user)
        return permissions.may_replay_others(user=user) or permissions.has_own_runs(user=user)

    def has_cancel_permission(self, request, obj=None):
        user = request.user
        if obj is not None:
            return permissions.is_own_run(actor=user, run=obj) or permissions.may_cancel_others(user=user)
        return permissions.may_cancel_others(user=user) or permissions.has_own_runs(user=user)

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        custom = [
            path(
                "<path:object_id>/input-file/",
                self.admin_site.admin_view(lambda request, object_id: run_page.input_file_view(self, request, object_id)),
                name="%s_%s_input_file" % info,
            ),
            path(
                "<path:object_id>/live/",
                self.admin_site.admin_view(lambda request, object_id: live.live_fragment_view(self, request, object_id)),
                name="%s_%s_live" % info,
            ),
            path(
                "<path:object_id>/calls/<str:call_id>/answer/",
                self.admin_site.admin_view(
                    lambda request, object_id, call_id: approvals.answer_call_view(self, request, object_id, call_id)
                ),
                name="%s_%s_answer_call" % info,
            ),
            path(
                "<path:object_id>/calls/<str:call_id>/settle/",
                self.admin_site.admin_view(
                    lambda request, object_id, call_id: settle.settle_call_view(self, request, object_id, call_id)
                ),
                name="%s_%s_settle_call" % info,
            ),
        ]
        return custom + super().get_urls()

    def change_view(self, request, object_id, form_url="", extra_context=None):
        run = self.get_object(request, unquote(object_id))
        extra_context = dict(extra_context or {})
        if run is not None and self.has_view_permission(request, run):
            decision = run_page.decision_now(run)
            resume_decision = resume.decide_resume(run)
            waits = approvals.approvals_context(run, user=request.user)
            doubts = settle.settle_context(run, decision["facts"], user=request.user)
            buttons = run_page.page_buttons(self, request, run, decision=decision, resume_decision=resume_decision)
            extra_context.update(
                timeline=timeline.timeline_items(timeline.run_events(run), error_code=run.error_code),
                replay_chain=run_page.replay_chain(run),
                decision=decision,
                resume_decision=resume_decision,
                **doubts,
                **waits,
                **run_page.outcome_context(run, waiting_calls=waits["waiting_calls"],
                                           calls_in_doubt=doubts["calls_in_doubt"]),
                can_force=self.has_force_replay_permission(request),
                **object_buttons(self, buttons),
                **run_page.workflow_steps_context(run),
                # While it runs, the page polls the live panel instead of showing a still timeline.
                **(live.live_context(run) if run.status in UNSETTLED else {}),
            )
        return super().change_view(request, object_id, form_url, extra_context)

    # --- Columns and fields ---

    @admin.display(description="status", ordering="status")
    def status_badge(self, run: AgentRun) -> str:
        return ledger.badge(run.status)

    @admin.display(description="run", ordering="run_id")
    def short_id(self, run: AgentRun) -> str:
        return str(run.run_id)[:8]

    @admin.display(description="tools called")
    def tools_called(self, run: AgentRun) -> str:
        # Each tool's name on one line: the cell wraps between tools, never inside a name.
        names = run_page.tools_label(run).split(", ")
        return format_html_join(", ", '<span class="nowrap">{}</span>', ((name,) for name in names))

    @admin.display(description="model retries")
    def model_retries_summary(self, run: AgentRun) -> str:
        return run_page.retries_label(run)

    @admin.display(description="took")
    def duration(self, run: AgentRun) -> str:
        if run.started_at is None or run.finished_at is None:
            return "—"
        seconds = (run.finished_at - run.started_at).total_seconds()
        return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"

    @admin.display(description="created", ordering="created_at")
    def created(self, run: AgentRun) -> str:
        # One line at any width: the date and minute in the desk's time zone, the seconds on hover.
        local = timezone.localtime(run.created_at)
        return format_html('<span class="nowrap" title="{}">{}</span>', ledger.when(run.created_at),
                           local.strftime("%Y-%m-%d %H:%M"))

    @admin.display(description="error", ordering="error_code")
    def error_code_label(self, run: AgentRun) -> str:
        return run.error_code or "—"

    @admin.display(description="replays / resumes")
    def lineage(self, run: AgentRun) -> str:
        """Where the run comes from and what came of it, in one column: replay of, replayed by, resume of."""
        parts = []
        if run.replay_of_id is not None:
            parts.append(format_html("replay of {}", self.replay_of_link(run)))
        if getattr(run, "latest_replay_id", None) is not None:
            parts.append(format_html("replayed by {}", self.latest_replay_link(run)))
        if run.resume_of_id is not None:
            url = reverse("admin:runs_agentrun_change", args=[run.resume_of_id])
            parts.append(format_html('resume of <a href="{}">{}</a>', url, str(run.resume_of_id)[:8]))
        if getattr(run, "latest_resume_id", None) is not None:
            url = reverse("admin:runs_agentrun_change", args=[run.latest_resume_id])
            parts.append(format_html('resumed by <a href="{}">{}</a>', url, str(run.latest_resume_id)[:8]))
        return format_html_join(mark_safe("<br>"), "{}", ((part,) for part in parts)) if parts else "—"

    @admin.display(description="replay of", ordering="replay_of")
    def replay_of_link(self, run: AgentRun) -> str:
        if run.replay_of_id is None:
            return "—"
        url = reverse("admin:runs_agentrun_change", args=[run.replay_of_id])
        label = str(run.replay_of_id)[:8]
        if "replay_of" in run._state.fields_cache and run.replay_of is not None:
            label = f"{label} ({run.replay_of.status})"
        return format_html('<a href="{}">{}</a>', url, label)

    @admin.display(description="resume of")
    def resume_of_link(self, run: AgentRun) -> str:
        if run.resume_of_id is None:
            return "—"
        url = reverse("admin:runs_agentrun_change", args=[run.resume_of_id])
        return format_html('<a href="{}">{}</a>', url, str(run.resume_of_id)[:8])

    @admin.display(description="resumed by")
    def resumes_links(self, run: AgentRun) -> str:
        resumes = list(run.resumes.order_by("created_at").values_list("run_id", "status")[:20])
        if not resumes:
            return "—"
        return format_html_join(", ", '<a href="{}">{}</a> ({})', (
            (reverse("admin:runs_agentrun_change", args=[run_id]), str(run_id)[:8], status)
            for run_id, status in resumes
        ))

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
        return run_page.pretty_json(run.params) if run.params else "—"

    @admin.display(description="input file")
    def input_file_link(self, run: AgentRun) -> str:
        if not run.input_file:
            return "—"
        size = f"{run.input_file_size} bytes" if run.input_file_size is not None else "size unknown"
        if run_page.stored_input_path(run) is None:
            return format_html("“{}” ({}) — the stored copy is gone from disk", run.input_file_name, size)
        url = reverse("admin:runs_agentrun_input_file", args=[run.run_id])
        return format_html('<a href="{}">{}</a> ({})', url, run.input_file_name, size)


