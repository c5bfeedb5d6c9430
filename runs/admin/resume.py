"""The run page's Resume button: a confirmation page with the preview, then `runs.services.run.resume_run`.

The page shows, per selected run, what a resume would do now (`decide_resume`): the refusal in
its own words, or how each dangling call would be answered and what the model will see. The
confirmed post resumes each run through the one service, so the permission (the run's creator,
or runs.replay_agentrun) and every refusal are the API's, reported once per run.
"""

from __future__ import annotations

import json

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect

from config.lib.admin import act_on_each, back, confirmation_page
from runs.admin.actions import change_url, run_label
from runs.models.ledger import AgentRun
from runs.rules import permissions, resume
from runs.services import run as services

TEMPLATE = "admin/runs/agentrun/resume_confirmation.html"


def resume_rows(runs: list[AgentRun], actor) -> list[dict]:
    rows = []
    for run in runs:
        decision = resume.decide_resume(run)
        rows.append({
            "run": run,
            "url": change_url(run),
            "permitted": permissions.may_resume(actor=actor, run=run),
            "allowed": decision.allowed,
            "refusal": decision.refusal.admin_detail if decision.refusal is not None else "",
            "preview": [
                {**answer.as_preview(), "model_sees_json": json.dumps(answer.response, ensure_ascii=False, indent=1)
                 if answer.response is not None else ""}
                for answer in decision.answers
            ],
        })
    return rows


@admin.action(permissions=["replay"], description="Resume selected runs…")
def resume_selected(modeladmin, request, queryset):
    """Confirm with the preview, then continue each run in its own session."""
    runs = list(queryset.order_by("created_at"))
    if request.POST.get("post"):
        created = act_on_each(
            modeladmin, request, runs,
            act=lambda run: services.resume_run(run.run_id, actor=request.user),
            label=run_label,
            success=lambda run, resumed: f"Resumed as run {str(resumed.run_id)[:8]} in the same session.",
        )
        if len(runs) == 1 and len(created) == 1:
            return HttpResponseRedirect(change_url(created[0]))
        return back(request)
    rows = resume_rows(runs, request.user)
    if not any(row["permitted"] for row in rows):
        # The API's rule: the run's creator, or runs.replay_agentrun.
        raise PermissionDenied
    return confirmation_page(
        modeladmin, request, TEMPLATE, title="Resume", objects=runs, rows=rows,
        any_allowed=any(row["allowed"] and row["permitted"] for row in rows),
    )
