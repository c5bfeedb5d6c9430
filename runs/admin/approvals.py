"""Deciding on a call that waits, from the run page: a door onto runs.ledger.approvals.

The page shows each call the run waits for, with an approve / reject form to holders of
`runs.approve_toolcall` (a result form for a long-running call to holders of
`runs.answer_toolcall`); the service checks the permissions again, so a crafted post gets the
same refusal as the API.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.admin.utils import unquote
from django.http import Http404, HttpResponseNotAllowed, HttpResponseRedirect

from config.lib import safe_json
from config.lib.refusals import Refusal
from runs.admin.actions import change_url
from runs.ledger import approvals
from runs.models.approvals import Decision, PendingCall
from runs.models.ledger import AgentRun
from runs.refusals import PayloadNotAllowed
from runs.rules import permissions
from runs.services import decisions


def approvals_context(run: AgentRun, *, user) -> dict:
    calls = approvals.pending_calls_of(run)
    return {
        "waiting_calls": [call for call in calls if call.is_open],
        "answered_calls": [call for call in calls if not call.is_open],
        "can_approve": permissions.may_decide_on(user=user, run=run),
        "can_answer": permissions.may_answer(user=user, run=run),
        "max_decision_note_chars": decisions.NOTE_MAX_CHARS,
    }


def _json_field(text: str, *, name: str):
    text = (text or "").strip()
    if not text:
        return None
    try:
        return safe_json.loads(text)
    except (ValueError, safe_json.UnsafeInput) as exc:
        raise PayloadNotAllowed(f"The {name} is not valid JSON: {exc}") from None


def answer_call_view(modeladmin, request, object_id: str, call_id: str):
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    run = modeladmin.get_object(request, unquote(object_id))
    if run is None or not modeladmin.has_view_permission(request, run):
        raise Http404("No such run.")
    # Quoted as the admin quotes keys: a call id may hold `/` (ADK leaves ids to the model or tool).
    call_id = unquote(call_id)
    try:
        if "result" in request.POST:
            pending: PendingCall = decisions.give_result(
                run_id=run.run_id, call_id=call_id, actor=request.user,
                result=_json_field(request.POST["result"], name="result"), note=request.POST.get("note", ""),
            )
        else:
            pending = decisions.decide_call(
                run_id=run.run_id, call_id=call_id, actor=request.user, decision=request.POST.get("decision", ""),
                note=request.POST.get("note", ""), payload=_json_field(request.POST.get("payload", ""), name="payload"),
            )
    except Refusal as refusal:
        modeladmin.message_user(request, f"Call {call_id}: {refusal.admin_detail}", messages.WARNING)
    else:
        run.refresh_from_db(fields=["status"])
        goes_on = ("The run goes on." if run.status != "waiting"
                   else "The run still waits for its other calls.")
        said = "given its result" if pending.decision == Decision.RESULT else pending.get_decision_display()
        modeladmin.message_user(request, f"Call {pending.call_id} ({pending.tool_name}) {said}. {goes_on}",
                                messages.SUCCESS)
    return HttpResponseRedirect(f"{change_url(run)}#waiting-calls")

