"""Hostile URLs and words: path segments, page sizes, call ids and notes answer 4xx, never 500.

On PostgreSQL a NUL in any URL path segment once reached a lookup and failed the query; a page
size longer than 4300 digits failed int(); a call id holding a '/' broke the run page for
everyone who may settle it; a settle note could carry bidi overrides into the audit trail.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.test import Client

from runs.models.ledger import AgentRun, RunStatus, ToolCall, ToolCallStatus
from tests.factories import make_run
from tests.kit import api, login, refused

pytestmark = pytest.mark.django_db

RUNS = "/admin/runs/agentrun/"


@pytest.fixture
def settler(django_user_model):
    user = django_user_model.objects.create_user("sue", password="sue-pass-123", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=["view_agentrun", "view_toolcall",
                                                                        "settle_toolcall"]))
    return user


def in_doubt(call_id: str) -> tuple[AgentRun, ToolCall]:
    run = make_run(status=RunStatus.ERROR)
    call = ToolCall.objects.create(run=run, seq=1, call_id=call_id, tool_name="send_email", effect="idempotent",
                                   status=ToolCallStatus.CALLED)
    AgentRun.objects.filter(pk=run.pk).update(tools_executed=["send_email"])
    return run, call


# --- NUL in a path segment ------------------------------------------------------------------------


def test_a_nul_in_a_webhook_slug_is_a_400_without_login():
    body = refused(Client().post("/api/webhooks/a%00b/", b"{}", content_type="application/json"), 400,
                   "invalid_path")
    assert "NUL" in body["detail"]


def test_a_nul_in_api_path_segments_is_a_400(settler):
    run, _ = in_doubt("call-1")
    client = api(settler)
    refused(client.get("/api/workflows/a%00b/"), 400, "invalid_path")
    refused(client.get("/api/agents/a%00b/"), 400, "invalid_path")
    refused(client.post(f"/api/runs/{run.run_id}/calls/a%00b/settle/", {"outcome": "done", "note": "Seen."},
                        format="json"), 400, "invalid_path")


def test_a_nul_in_the_admins_settle_url_is_a_400(settler):
    run, call = in_doubt("call-1")
    client = login(settler)
    refused(client.post(f"{RUNS}{run.pk}/calls/a%00b/settle/", {"outcome": "done", "note": "Seen."}), 400,
            "invalid_path")
    call.refresh_from_db()
    assert call.settled_outcome == ""


# --- Page sizes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("digits", [4301, 10_000])
def test_a_page_size_of_thousands_of_digits_is_a_400_that_does_not_echo_it(alice, digits):
    body = refused(api(alice).get("/api/runs/", {"page_size": "9" * digits}), 400, "invalid")
    assert "page_size" in body["detail"]
    assert len(body["detail"]) < 300


# --- Call ids holding a '/' ------------------------------------------------------------------------------


def test_a_call_id_with_a_slash_can_be_settled_from_the_run_page(settler):
    run, call = in_doubt("tools/send_email/1")
    client = login(settler)
    page = client.get(f"{RUNS}{run.pk}/change/")
    assert page.status_code == 200
    action = f"{RUNS}{run.pk}/calls/tools_2Fsend_5Femail_2F1/settle/"
    assert f'action="{action}"' in page.content.decode()
    client.post(action, {"outcome": "done", "note": "The outbox shows the email."})
    call.refresh_from_db()
    assert (call.settled_outcome, call.settled_by) == ("done", settler)


def test_a_call_id_with_a_slash_can_be_settled_through_the_api(settler):
    run, call = in_doubt("tools/send_email/1")
    response = api(settler).post(f"/api/runs/{run.run_id}/calls/tools/send_email/1/settle/",
                                 {"outcome": "not_done", "note": "Nothing in the outbox."}, format="json")
    assert response.status_code == 200, response.content
    call.refresh_from_db()
    assert call.settled_outcome == "not_done"


# --- Notes a person reads ------------------------------------------------------------------------------


@pytest.mark.parametrize("note", [
    "Sent \u202eliame on\u202c.",  # RIGHT-TO-LEFT OVERRIDE: reads as something else
    "Checked\u2066 the outbox\u2069",
    "zero\u200bwidth",
    "bell\x07",
    "escape \x1b[31mred\x1b[0m",
])
def test_a_settle_note_with_bidi_or_control_characters_is_refused(settler, note):
    run, call = in_doubt("call-1")
    body = refused(api(settler).post(f"/api/runs/{run.run_id}/calls/call-1/settle/",
                                     {"outcome": "done", "note": note}, format="json"), 400, "note_invalid")
    assert "U+" in body["detail"]
    call.refresh_from_db()
    assert call.settled_outcome == ""


def test_a_settle_note_may_span_lines(settler):
    run, call = in_doubt("call-1")
    response = api(settler).post(f"/api/runs/{run.run_id}/calls/call-1/settle/",
                                 {"outcome": "done", "note": "Outbox:\n\tthe email to Jane is there."}, format="json")
    assert response.status_code == 200, response.content


def test_the_schema_says_what_a_settle_note_may_hold(settler):
    schema = api(settler).get("/api/schema/", {"format": "json"}).json()
    note = schema["components"]["schemas"]["SettleRequestRequest"]["properties"]["note"]
    # A format of the API's own (tests/fuzz_hooks.py tells the fuzzer what it means): a request
    # the schema calls valid is one the note rule accepts.
    assert note["format"] == "plain-words"
    assert "bidi" in note["description"]


# --- Hosts and sizes --------------------------------------------------------------------------------------


def test_an_unknown_host_is_a_json_400_for_the_api():
    body = refused(Client(HTTP_HOST="evil.example").get("/api/runs/"), 400, "invalid_host")
    assert "evil.example" not in body["detail"]
    page = Client(HTTP_HOST="evil.example").get("/admin/")
    assert page.status_code == 400  # the admin keeps Django's page


def test_an_upload_just_over_the_limit_is_a_413(no_worker, alice, settings, tmp_path):
    from django.core.files.uploadedfile import SimpleUploadedFile


    settings.MAX_UPLOAD_BYTES = 1000
    upload = SimpleUploadedFile("invoice.txt", b"x" * 1100, content_type="text/plain")
    response = api(alice).post("/api/runs/", {"agent": "support", "owner_id": "jane", "message": "Read it.",
                                              "file": upload}, format="multipart")
    body = refused(response, 413, "request_too_large")
    assert body["limit"] == 1000 and "MAX_UPLOAD_BYTES" in body["detail"]
    assert not AgentRun.objects.exists()


@pytest.mark.parametrize("path", ["/api/runs/", "/api/chat/", "/api/webhooks/inbound/", "/api/memory/"])
def test_trace_is_a_405_that_says_what_is_allowed(alice, path):
    response = api(alice).generic("TRACE", path)
    refused(response, 405, "method_not_allowed")
    assert response["Allow"]
