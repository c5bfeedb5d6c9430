"""The run desk's actions: doors onto runs.services.run, with the same refusals as the API.

Refusals are worded for the admin (“Use “Force replay…” …” instead of “Pass force=true …”) and
reported once per run. Replaying and cancelling need the same permissions as the API's doors
(`runs.rules.permissions`): each action is offered to holders of its permission, and to people with
runs of their own (which need none); someone else's run is then refused per run by the service.
"""

from __future__ import annotations

import json

from django.contrib import admin, messages
from django.http import HttpResponseRedirect
from django.urls import reverse

from config.lib.admin import ActionChoice, ReasonedAction, act_on_each, back, confirm_with_reason
from runs.ledger import reconcile
from runs.models.ledger import AgentRun, EffectsChoice, RunStatus
from runs.rules import permissions
from runs.rules import replay as rules
from runs.services import run as services


def run_label(run: AgentRun) -> str:
    return f"{run.agent_name} run {str(run.run_id)[:8]}"


def change_url(run: AgentRun) -> str:
    return reverse("admin:runs_agentrun_change", args=[run.run_id])


def journal_rows(run: AgentRun) -> list[dict]:
    """The run's tool journal with each call's arguments as one line, for confirmation pages."""
    return [
        {"call": call, "args": json.dumps(call.args, ensure_ascii=False)} for call in run.tool_calls.order_by("seq")
    ]


def called_tools(run: AgentRun) -> list[str] | None:
    """Each tool once in first-call order; None when unknown."""
    return rules.tool_names_once(run.tools_executed) if run.tools_executed is not None else None


def _replay_each(
    modeladmin, request, runs, *, force: bool, reason: str = "", effects: str = EffectsChoice.REUSE
) -> list[AgentRun]:
    return act_on_each(
        modeladmin,
        request,
        runs,
        act=lambda run: services.replay_run(
            run.run_id, actor=request.user, force=force, reason=reason, effects=effects
        ),
        label=run_label,
        success=lambda run, replay: (
            f"{'Force-replayed' if replay.forced else 'Replayed'} as run {str(replay.run_id)[:8]}"
            f"{' (effects redone)' if replay.effects == EffectsChoice.REDO else ''}."
        ),
    )


def _after_replay(request, created: list[AgentRun], *, selected: int):
    """One run replayed on its own: open the new run. Otherwise back where the person was."""
    if selected == 1 and len(created) == 1:
        return HttpResponseRedirect(change_url(created[0]))
    return back(request)


@admin.action(permissions=["replay"], description="Replay selected runs")
def replay_selected(modeladmin, request, queryset):
    runs = list(queryset.order_by("created_at"))
    created = _replay_each(modeladmin, request, runs, force=False)
    return _after_replay(request, created, selected=len(runs))


@admin.action(permissions=["cancel"], description="Cancel selected runs")
def cancel_selected(modeladmin, request, queryset):
    act_on_each(
        modeladmin,
        request,
        queryset.order_by("created_at"),
        act=lambda run: services.cancel_run(run.run_id, actor=request.user),
        label=run_label,
        success=lambda run, cancelled: (
            "cancelled; it will not start."
            if cancelled.status == RunStatus.CANCELLED
            else "cancellation requested; its worker stops it within one heartbeat."
        ),
    )
    return back(request)


def force_replay_rows(runs) -> list[dict]:
    """For each run: what it already called, and what forcing would do with it."""
    rows = []
    for run in runs:
        facts = rules.gather_facts(run)
        forced = rules.decide(run, force=True, facts=facts)
        rows.append(
            {
                "run": run,
                "preview": rules.preview(facts),
                "url": change_url(run),
                "tools": called_tools(run),
                "journal": journal_rows(run),
                "blocked": forced.refusal.admin_detail if forced.refusal is not None else "",
                # The reason alone: this page is where "Use “Force replay…”" would send them.
                "overrides": forced.overridden.sentence if forced.overridden is not None else "",
            }
        )
    return rows


FORCE_REPLAY = ReasonedAction(
    name="force_replay_selected",
    slug="force-replay",
    title="Force replay",
    question=(
        "Are you sure you want to force a replay of the selected {objects_name}? Each replay is a new run with the "
        "same input. Choose what happens to the effects a run recorded: reused (an email recorded as sent is not "
        "sent again) or redone (it is sent again). Tools with no effect record that act in the world are called "
        "again either way."
    ),
    submit="Yes, force the replay",
    row_template="admin/runs/agentrun/force_replay_row.html",
    check_reason=services.check_force_reason,
    max_reason_chars=services.MAX_FORCE_REASON_CHARS,
    choice=ActionChoice(
        name="effects",
        label="Recorded effects",
        options=(
            (EffectsChoice.REUSE, "Replay, reusing recorded effects",
             "an effect recorded as done is served from its record: no second email, no second note."),
            (EffectsChoice.REDO, "Replay and redo the effects",
             "new keys: every email is sent again and every note written again."),
        ),
        default=EffectsChoice.REUSE,
    ),
)


@admin.action(permissions=["force_replay"], description="Force replay…")
def force_replay_selected(modeladmin, request, queryset):
    """Confirm, with a reason, then replay even what the rules refuse."""
    runs = list(queryset.order_by("created_at"))

    def perform(selected, reason, effects):
        created = _replay_each(modeladmin, request, selected, force=True, reason=reason, effects=effects)
        return _after_replay(request, created, selected=len(selected))

    return confirm_with_reason(
        modeladmin, request, queryset, runs,
        action=FORCE_REPLAY,
        permitted=permissions.may_force_replay(user=request.user),
        rows=force_replay_rows,
        perform=perform,
    )


@admin.action(description="Reconcile stale runs now")
def reconcile_stale_runs_now(modeladmin, request, queryset):
    landed = reconcile.reconcile_stale_runs(queryset=queryset)
    for run in landed:
        modeladmin.message_user(request, f"Run {run.run_id} reconciled. {run.error_message}", messages.SUCCESS)
    landed_ids = {run.pk for run in landed}
    # Bounded: with "select all" the selection can be the whole table.
    alive = (
        queryset.select_related(None)
        .filter(status=RunStatus.RUNNING)
        .exclude(pk__in=landed_ids)
        .only("run_id", "heartbeat_at")
    )
    for run in alive[:50]:
        modeladmin.message_user(
            request,
            f"Run {run.run_id} is still running and sending heartbeats"
            f"{f' (last at {run.heartbeat_at:%H:%M:%S} UTC)' if run.heartbeat_at else ''}: left alone.",
            messages.WARNING,
        )
    if not landed:
        modeladmin.message_user(request, "None of the selected runs is stale: nothing was reconciled.", messages.INFO)
