"""Settling a call in doubt from the run page: a door onto runs.services.decisions.settle_call.

The page shows a small form per call in doubt to those who hold `runs.settle_toolcall`; the
service checks the permission again, so a crafted post gets the same refusal as the API.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.admin.utils import unquote
from django.http import Http404, HttpResponseNotAllowed, HttpResponseRedirect

from config.lib.refusals import Refusal
from runs.admin.actions import change_url
from runs.models.ledger import AgentRun, SettledOutcome, ToolCall
from runs.rules import permissions
from runs.rules import replay as rules
from runs.services import decisions


def settle_context(run: AgentRun, facts: rules.ReplayFacts, *, user) -> dict:
    """The run page's calls in doubt (each with its form) and the settlements already recorded."""
    doubt_ids = [call.call_id for call in facts.calls if call.in_doubt]
    calls = run.tool_calls.select_related("settled_by").order_by("seq")
    return {
        "calls_in_doubt": list(calls.filter(call_id__in=doubt_ids)) if doubt_ids and not run.is_in_flight else [],
        "settled_calls": list(calls.exclude(settled_outcome="")),
        "can_settle": permissions.may_settle(user=user),
        "settle_outcomes": SettledOutcome.choices,
        "max_note_chars": decisions.MAX_NOTE_CHARS,
    }


def settle_call_view(modeladmin, request, object_id: str, call_id: str):
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    run = modeladmin.get_object(request, unquote(object_id))
    if run is None or not modeladmin.has_view_permission(request, run):
        raise Http404("No such run.")
    # The page quotes the call id as the admin quotes keys: ids are the model's, and may hold a '/'.
    call_id = unquote(call_id)
    try:
        call: ToolCall = decisions.settle_call(
            run_id=run.run_id,
            call_id=call_id,
            actor=request.user,
            outcome=request.POST.get("outcome", ""),
            note=request.POST.get("note", ""),
        )
    except Refusal as refusal:
        modeladmin.message_user(request, f"Call {call_id}: {refusal.admin_detail}", messages.WARNING)
    else:
        modeladmin.message_user(
            request,
            f"Call {call.call_id} ({call.tool_name}) settled as {call.get_settled_outcome_display()}. "
            "The run's outcome is unchanged; the replay rules now read your settlement.",
            messages.SUCCESS,
        )
    return HttpResponseRedirect(f"{change_url(run)}#calls-in-doubt")
