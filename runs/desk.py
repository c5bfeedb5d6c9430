"""The support desk's pieces for the run admin: filters, actions, the stored-file view.

Actions are doors onto runs.services like the API: the same refusals, worded for the admin
(“Use “Force replay…” …” instead of “Pass force=true …”), reported once per run.
"""

from __future__ import annotations

import json

from pathlib import Path

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import model_ngettext, unquote
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import FileResponse, Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.http import url_has_allowed_host_and_scheme

from agents.registry import AGENTS
from runs import replay as rules
from runs import services
from runs.models import AgentRun
from runs.refusals import Refusal

FORCE_REPLAY_TEMPLATE = "admin/runs/agentrun/force_replay_confirmation.html"


def run_label(run: AgentRun) -> str:
    return f"{run.agent_name} run {str(run.run_id)[:8]}"


def change_url(run: AgentRun) -> str:
    return reverse("admin:runs_agentrun_change", args=[run.run_id])


# --- Filters -------------------------------------------------------------------------------------


class AgentFilter(admin.SimpleListFilter):
    """The registered agents, without a SELECT DISTINCT over the whole table."""

    title = "agent"
    parameter_name = "agent"

    def lookups(self, request, model_admin):
        from agents.models import WorkflowDefinition

        workflows = WorkflowDefinition.objects.values_list("name", flat=True)[:200]
        return [(name, name) for name in sorted(AGENTS)] + [(name, f"{name} (workflow)") for name in workflows]

    def queryset(self, request, queryset):
        return queryset.filter(agent_name=self.value()) if self.value() else queryset


class ToolsStateFilter(admin.SimpleListFilter):
    title = "tools called"
    parameter_name = "tools"

    def lookups(self, request, model_admin):
        return [
            ("unknown", "unknown (no evidence either way)"),
            ("none", "none (checked)"),
            ("called", "called one or more"),
        ]

    def queryset(self, request, queryset):
        value = self.value()
        if value == "unknown":
            return queryset.filter(tools_executed__isnull=True)
        if value == "none":
            return queryset.filter(tools_executed=[])
        if value == "called":
            return queryset.filter(tools_executed__isnull=False).exclude(tools_executed=[])
        return queryset


# --- A list that stays fast on millions of runs ----------------------------------------------------


class CappedCountPaginator(Paginator):
    """Counts at most `cap` rows: COUNT(*) over millions of runs is what makes a list page slow.

    Past the cap the list says “10000+”; filters and search narrow it down from there.
    """

    cap = 10_000

    @cached_property
    def count(self) -> int:
        # Only the primary keys, unordered: the list's annotations and ordering cost nothing here.
        counted = self.object_list.order_by().values("pk")[: self.cap + 1].count()
        self.capped = counted > self.cap
        return min(counted, self.cap)


# --- Actions -------------------------------------------------------------------------------------


def _safe_next(request) -> str | None:
    target = request.POST.get("next", "")
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        return target
    return None


def _replay_each(modeladmin, request, runs, *, force: bool, reason: str = "") -> list[AgentRun]:
    created: list[AgentRun] = []
    for run in runs:
        try:
            replay = services.replay_run(run.run_id, actor=request.user, force=force, reason=reason)
        except Refusal as refusal:
            modeladmin.message_user(request, f"{run_label(run)}: {refusal.admin_detail}", messages.WARNING)
            continue
        created.append(replay)
        verb = "Force-replayed" if replay.forced else "Replayed"
        modeladmin.message_user(
            request, f"{run_label(run)}: {verb} as run {str(replay.run_id)[:8]}.", messages.SUCCESS
        )
    return created


def _after_replay(request, created: list[AgentRun], *, selected: int):
    """One run replayed on its own: open the new run. Otherwise back where the person was."""
    if selected == 1 and len(created) == 1:
        return HttpResponseRedirect(change_url(created[0]))
    target = _safe_next(request)
    return HttpResponseRedirect(target) if target else None


@admin.action(permissions=["view"], description="Replay selected runs")
def replay_selected(modeladmin, request, queryset):
    runs = list(queryset.order_by("created_at"))
    created = _replay_each(modeladmin, request, runs, force=False)
    return _after_replay(request, created, selected=len(runs))


@admin.action(permissions=["view"], description="Cancel selected runs")
def cancel_selected(modeladmin, request, queryset):
    for run in queryset.order_by("created_at"):
        try:
            cancelled = services.cancel_run(run.run_id, actor=request.user)
        except Refusal as refusal:
            modeladmin.message_user(request, f"{run_label(run)}: {refusal.admin_detail}", messages.WARNING)
            continue
        if cancelled.status == "cancelled":
            text = "cancelled; it will not start."
        else:
            text = "cancellation requested; its worker stops it within one heartbeat."
        modeladmin.message_user(request, f"{run_label(run)}: {text}", messages.SUCCESS)
    target = _safe_next(request)
    return HttpResponseRedirect(target) if target else None


def force_replay_rows(runs) -> list[dict]:
    """For each run: what it already called, and what forcing would do with it."""
    rows = []
    for run in runs:
        facts = rules.gather_facts(run)
        forced = rules.decide(run, force=True, facts=facts)
        rows.append(
            {
                "run": run,
                "url": change_url(run),
                "tools": rules.tool_names_once(run.tools_executed) if run.tools_executed is not None else None,
                "journal": [
                    {"call": call, "args": json.dumps(call.args, ensure_ascii=False)}
                    for call in run.tool_calls.order_by("seq")
                ],
                "blocked": forced.refusal.admin_detail if forced.refusal is not None else "",
                "overrides": forced.overridden.admin_detail if forced.overridden is not None else "",
            }
        )
    return rows


@admin.action(permissions=["force_replay"], description="Force replay…")
def force_replay_selected(modeladmin, request, queryset):
    """Confirm, with a reason, then replay even what the rules refuse (Django's delete_selected pattern)."""
    if not modeladmin.has_force_replay_permission(request):
        raise PermissionDenied
    runs = list(queryset.order_by("created_at"))
    reason = request.POST.get("reason", "").strip()
    error = ""

    # The user has already confirmed: replay, then show the change list (or the new run) again.
    if request.POST.get("post"):
        if reason and len(reason) <= services.MAX_FORCE_REASON_CHARS:
            created = _replay_each(modeladmin, request, runs, force=True, reason=reason)
            return _after_replay(request, created, selected=len(runs))
        error = (
            "Give a reason: say why running these runs again is acceptable."
            if not reason
            else f"The reason is longer than {services.MAX_FORCE_REASON_CHARS} characters."
        )

    opts = modeladmin.model._meta
    objects_name = model_ngettext(queryset)
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": "Force replay",
        "subtitle": None,
        "objects_name": str(objects_name),
        "rows": force_replay_rows(runs),
        "queryset": runs,
        "reason": reason,
        "reason_error": error,
        "max_reason_chars": services.MAX_FORCE_REASON_CHARS,
        "next": _safe_next(request) or "",
        "opts": opts,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": modeladmin.media,
    }
    request.current_app = modeladmin.admin_site.name
    return TemplateResponse(request, FORCE_REPLAY_TEMPLATE, context)


# --- The stored input file -----------------------------------------------------------------------


def stored_input_path(run: AgentRun) -> Path | None:
    """The stored copy, if it exists and lies inside RUN_INPUTS_DIR (a row is never trusted blindly)."""
    if not run.input_file:
        return None
    root = Path(settings.RUN_INPUTS_DIR).resolve()
    path = Path(run.input_file).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        return None
    return path


def input_file_view(modeladmin, request, object_id):
    """Streams the run's stored input file to staff who may view the run; the disk path stays hidden."""
    run = modeladmin.get_object(request, unquote(object_id))
    if run is None or not modeladmin.has_view_permission(request, run):
        raise Http404("No such run.")
    path = stored_input_path(run)
    if path is None:
        raise Http404("This run has no stored input file, or it is gone from disk.")
    return FileResponse(path.open("rb"), as_attachment=True, filename=run.input_file_name or path.name)


# --- The run page --------------------------------------------------------------------------------

MAX_CHAIN_RUNS = 200


def replay_chain(run: AgentRun) -> list[dict]:
    """The run's family: up to the first original, then every replay below it, indented."""
    root = run
    for _ in range(MAX_CHAIN_RUNS):
        if root.replay_of_id is None:
            break
        parent = AgentRun.objects.filter(pk=root.replay_of_id).first()
        if parent is None:
            break
        root = parent
    children: dict = {}
    level = [root.run_id]
    total = 1
    while level and total < MAX_CHAIN_RUNS:
        found = list(AgentRun.objects.filter(replay_of_id__in=level).order_by("created_at")[:MAX_CHAIN_RUNS])
        for child in found:
            children.setdefault(child.replay_of_id, []).append(child)
        total += len(found)
        level = [child.run_id for child in found]

    rows: list[dict] = []

    def walk(node: AgentRun, depth: int) -> None:
        rows.append({"run": node, "depth": depth, "indent": depth * 1.5, "url": change_url(node),
                     "current": node.run_id == run.run_id})
        for child in children.get(node.run_id, []):
            walk(child, depth + 1)

    walk(root, 0)
    return rows


def decision_now(run: AgentRun) -> dict:
    facts = rules.gather_facts(run)
    plain = rules.decide(run, force=False, facts=facts)
    forced = rules.decide(run, force=True, facts=facts)
    return {
        "allowed": plain.allowed,
        "code": plain.code,
        "message": "A replay would start now." if plain.allowed else plain.refusal.admin_detail,
        "force_would_replay": forced.allowed,
        "force_message": "" if forced.allowed else forced.refusal.admin_detail,
    }
