"""Hostile input at the doors added last: waiting calls, admin actions, saved params, words.

A waiting call whose id holds a '/' must be answerable from the run page and the API; a crafted
admin action with a malformed key is a message, not a 500; params saved by staff carry scripted
faults only under the permission; decision and result notes and force reasons refuse bidi and
control characters, as settle notes do.
"""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Permission
from django.test import Client

from runs import services
from runs.models import AgentRun, PendingCall, RunSchedule, RunStatus, WaitKind, WebhookSource
from tests.factories import make_run
from tests.test_hostile_urls import api, refused
from tests.test_owner_rule import login, schedule_form, scheduler, source_form  # noqa: F401 - fixture

pytestmark = pytest.mark.django_db

RUNS = "/admin/runs/agentrun/"


@pytest.fixture
def lead(django_user_model):
    user = django_user_model.objects.create_user("lex", password="lex-pass-123", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=[
        "view_agentrun", "view_toolcall", "approve_toolcall", "answer_toolcall", "act_for_any_owner",
        "replay_agentrun", "force_replay_agentrun"]))
    return user


def waiting_on(call_id: str, *, kind: str = WaitKind.CONFIRMATION) -> tuple[AgentRun, PendingCall]:
    run = make_run(status=RunStatus.WAITING)
    pending = PendingCall.objects.create(run=run, kind=kind, call_id=call_id, request_call_id="adk-confirm-1",
                                         tool_name="issue_refund", args={"order_id": "A-1"})
    return run, pending


# --- Call ids holding a '/' --------------------------------------------------------------------------------


def test_a_waiting_call_whose_id_holds_a_slash_is_decided_from_the_run_page(lead):
    run, pending = waiting_on("tools/refund/1")
    client = Client()
    client.force_login(lead)
    page = client.get(f"{RUNS}{run.pk}/change/")
    assert page.status_code == 200
    action = f"{RUNS}{run.pk}/calls/tools_2Frefund_2F1/answer/"
    assert f'action="{action}"' in page.content.decode()
    client.post(action, {"decision": "reject", "note": "Not due."})
    pending.refresh_from_db()
    assert (pending.decision, pending.decided_by) == ("reject", lead)


@pytest.mark.parametrize("path", ["tools/refund/1", "tools%2Frefund%2F1"])
def test_a_waiting_call_whose_id_holds_a_slash_is_decided_through_the_api(lead, path):
    run, pending = waiting_on("tools/refund/1")
    response = api(lead).post(f"/api/runs/{run.run_id}/calls/{path}/decision/", {"decision": "reject"}, format="json")
    assert response.status_code == 202, response.content
    pending.refresh_from_db()
    assert pending.decision == "reject"


# --- A malformed key in an admin action ---------------------------------------------------------------------


@pytest.mark.parametrize(("url", "action"), [
    (RUNS, "replay_selected"), (RUNS, "cancel_selected"),
    ("/admin/runs/webhookevent/", "mark_resolved"), ("/admin/runs/ownergrant/", "delete_selected"),
])
def test_a_malformed_key_in_an_admin_action_is_a_message_not_a_500(admin_user, url, action):
    client = Client(raise_request_exception=False)
    client.force_login(admin_user)
    response = client.post(url, {"action": action, "_selected_action": ["not-a-key\u202e"]}, follow=True)
    assert response.status_code == 200
    said = [str(message) for message in response.context["messages"]]
    assert any("is not the key of any" in message for message in said), said


# --- Faults in params staff save --------------------------------------------------------------------------------


CRASHING = json.dumps({"script": [{"call": "lookup_customer", "args": {"email": "j@example.com"},
                                   "crash": "before_effect"}]})


@pytest.mark.parametrize(("url", "form", "model"), [
    ("/admin/runs/runschedule/add/", schedule_form, RunSchedule),
    ("/admin/runs/webhooksource/add/", source_form, WebhookSource),
])
def test_staff_save_params_with_faults_only_with_the_permission(scheduler, url, form, model):  # noqa: F811
    client = login(scheduler)
    response = client.post(url, form(owner_id="skye", params=CRASHING))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert "runs.place_tool_faults" in " ".join(errors["params"]), errors
    assert not model.objects.exists()

    scheduler.user_permissions.add(Permission.objects.get(codename="place_tool_faults"))
    client = login(type(scheduler).objects.get(pk=scheduler.pk))
    assert client.post(url, form(owner_id="skye", params=CRASHING)).status_code == 302
    assert model.objects.count() == 1


# --- Words a person reads --------------------------------------------------------------------------------------


HIDDEN = ["Approved \u202eetad\u202c.", "bell\x07", "zero\u200bwidth"]


@pytest.mark.parametrize("note", HIDDEN)
def test_a_decision_note_with_bidi_or_control_characters_is_refused(lead, note):
    run, pending = waiting_on("call-1")
    body = refused(api(lead).post(f"/api/runs/{run.run_id}/calls/call-1/decision/",
                                  {"decision": "approve", "note": note}, format="json"), 400, "note_invalid")
    assert "U+" in body["detail"]
    pending.refresh_from_db()
    assert pending.decision == ""


@pytest.mark.parametrize("note", HIDDEN)
def test_a_result_note_with_bidi_or_control_characters_is_refused(lead, note):
    run, pending = waiting_on("call-1", kind=WaitKind.RESULT)
    refused(api(lead).post(f"/api/runs/{run.run_id}/calls/call-1/result/",
                           {"result": {"ok": True}, "note": note}, format="json"), 400, "note_invalid")
    pending.refresh_from_db()
    assert pending.decision == ""


@pytest.mark.parametrize("reason", HIDDEN)
def test_a_force_reason_with_bidi_or_control_characters_is_refused(reason):
    with pytest.raises(services.ReasonHasHiddenCharacters):
        services.check_force_reason(reason)
    assert services.check_force_reason("The customer confirmed\non the phone.").startswith("The customer")
