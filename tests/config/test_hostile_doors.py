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
from django.core.cache import cache
from django.test import Client

from runs.models.approvals import PendingCall, WaitKind
from runs.models.inbox import WebhookSource
from runs.models.ledger import AgentRun, RunStatus
from runs.models.schedules import RunSchedule
from runs.models.tokens import ApiToken
from runs.services import run as services
from tests.factories import make_run
from tests.kit import api, login, refused
from tests.rules.test_owner_rule import schedule_form, scheduler, source_form  # noqa: F401 - fixture

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
    client = login(lead)
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


# --- JSON that means two things ---------------------------------------------------------------------------------


def test_a_json_body_with_a_repeated_key_is_refused(alice, no_worker):
    body = b'{"agent": "support", "owner_id": "jane", "message": "Hi.", "owner_id": "alice"}'
    response = api(alice).post("/api/runs/", body, content_type="application/json")
    refused(response, 400)
    assert "'owner_id' appears twice" in response.json()["detail"]
    assert not AgentRun.objects.exists()


# --- Hosts, headers, guessing -----------------------------------------------------------------------------------


def test_an_unknown_host_on_the_api_is_json_under_debug_too(settings):
    settings.DEBUG = True
    body = refused(Client(HTTP_HOST="evil.example").get("/api/runs/"), 400, "invalid_host")
    assert "evil.example" not in body["detail"]


def test_the_admin_sends_a_content_security_policy(admin_user, settings):
    client = login(admin_user)
    page = client.get("/admin/runs/agentrun/")
    assert page.status_code == 200
    assert "script-src 'self'" in page["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in page["Content-Security-Policy"]
    assert "Content-Security-Policy" not in api(admin_user).get("/api/runs/")
    settings.ADMIN_CONTENT_SECURITY_POLICY = ""
    assert "Content-Security-Policy" not in client.get("/admin/runs/agentrun/")


def test_failed_token_authentications_from_one_address_are_paced(alice, settings):
    cache.clear()
    settings.THROTTLE_RATES = {**settings.THROTTLE_RATES, "auth.failed_token": "3/min"}
    good = ApiToken.objects.create(user=alice).key
    guesser = Client(REMOTE_ADDR="198.51.100.7")
    for attempt in range(3):
        answer = guesser.get("/api/runs/", HTTP_AUTHORIZATION=f"Token guess-{attempt:040d}")
        assert answer.status_code == 401, answer.content
    paced = guesser.get("/api/runs/", HTTP_AUTHORIZATION=f"Token {good}")
    refused(paced, 429)
    assert int(paced["Retry-After"]) > 0
    assert Client(REMOTE_ADDR="198.51.100.8").get("/api/runs/", HTTP_AUTHORIZATION=f"Token {good}").status_code == 200


def test_one_password_sprayed_over_many_usernames_locks_the_address_out(django_user_model, settings):
    settings.AXES_ENABLED = True
    settings.LOGIN_FAILURE_LIMIT, settings.LOGIN_ADDRESS_FAILURE_LIMIT = 3, 4
    django_user_model.objects.create_user("staff", password="right-pass-123", is_staff=True)
    sprayer = Client(REMOTE_ADDR="203.0.113.5")
    for name in ("ann", "ben", "cy", "dee"):
        sprayer.post("/admin/login/?next=/admin/", {"username": name, "password": "Spring2026!"})
    locked = sprayer.post("/admin/login/?next=/admin/", {"username": "staff", "password": "right-pass-123"})
    assert locked.status_code == 429
    elsewhere = Client(REMOTE_ADDR="203.0.113.6")
    assert elsewhere.post("/admin/login/?next=/admin/",
                          {"username": "staff", "password": "right-pass-123"}).status_code == 302


# --- Offers and names ---------------------------------------------------------------------------------------------


def test_resume_is_offered_only_to_whom_may_resume_a_run_that_ended(bob, run_viewer, support_agent):
    waiting = make_run(status=RunStatus.WAITING, created_by=bob)
    failed = make_run(status=RunStatus.ERROR, created_by=bob)
    viewer = login(run_viewer)
    for run in (failed, waiting):
        page = viewer.get(f"{RUNS}{run.pk}/change/")
        assert page.status_code == 200 and "resume-button" not in page.content.decode()
    owner = login(support_agent)
    assert "resume-button" in owner.get(f"{RUNS}{failed.pk}/change/").content.decode()
    assert "resume-button" not in owner.get(f"{RUNS}{waiting.pk}/change/").content.decode()


def test_an_uploaded_file_name_over_255_characters_is_refused_not_cut(alice, no_worker):
    name = "a" * 300 + ".txt"
    boundary = "BoUnDaRy"
    parts = [
        *(f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"\r\n\r\n{value}\r\n'
          for field, value in (("agent", "support"), ("owner_id", "jane"), ("message", "Read it."))),
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
        "Content-Type: text/plain\r\n\r\nhello\r\n",
        f"--{boundary}--\r\n",
    ]
    response = api(alice).post("/api/runs/", "".join(parts).encode(),
                               content_type=f"multipart/form-data; boundary={boundary}")
    body = refused(response, 400)
    assert "longer than 255 characters" in json.dumps(body)
    assert not AgentRun.objects.exists()
