"""The live part of a run's page: what changes while it runs, served as a fragment to poll.

While a run is in flight its page polls `<run>/live/` (a few lines of `runs/live-run.js`) and
swaps in the fragment: status, heartbeat age, tool calls, steps and the session timeline. The
fragment says when the run has settled, and the page stops polling.
"""

from __future__ import annotations

from django.contrib.admin.utils import unquote
from django.http import Http404, HttpRequest
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone

from runs.ledger import timeline
from runs.models.approvals import PendingCall
from runs.models.ledger import UNSETTLED, AgentRun, RunStatus

TEMPLATE = "admin/runs/agentrun/live.html"
POLL_MILLISECONDS = 1500


def live_context(run: AgentRun) -> dict:
    """What the live panel shows now; read fresh on every poll (a handful of small queries)."""
    heartbeat_age = (timezone.now() - run.heartbeat_at).total_seconds() if run.heartbeat_at else None
    return {
        "live_run": run,
        "live_unsettled": run.status in UNSETTLED,
        "live_waiting": (list(PendingCall.objects.filter(run_id=run.run_id, decision="").order_by("asked_at"))
                         if run.status == RunStatus.WAITING else []),
        "live_url": reverse("admin:runs_agentrun_live", args=[run.pk]),
        "live_every_ms": POLL_MILLISECONDS,
        "heartbeat_age": heartbeat_age,
        "live_calls": list(run.tool_calls.order_by("seq")),
        "live_steps": list(run.steps.order_by("seq")) if run.workflow else [],
        "live_timeline": timeline.timeline_items(timeline.run_events(run), error_code=run.error_code),
    }


def live_fragment_view(modeladmin, request: HttpRequest, object_id: str) -> TemplateResponse:
    """The fragment, for staff who may view the run (reconciled on read, like the page)."""
    run = modeladmin.get_object(request, unquote(object_id))
    if run is None or not modeladmin.has_view_permission(request, run):
        raise Http404("No such run.")
    return TemplateResponse(request, TEMPLATE, live_context(run))
