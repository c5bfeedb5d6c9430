"""The runs API: contracts, visibility, refusals and bad input."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest
from django.core.management import call_command
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs.models.ledger import AgentRun, RunStatus
from runs.services import run as services
from tests.factories import (
    ADMIN_HINT,
    API_HINT,
    TABLE,
    TOOLS_CALLED_API,
    TOOLS_UNKNOWN_API,
    make_run,
    run_in_state,
)
from tests.helpers import SAY_DONE, SEND_EMAIL, UPDATE_CRM, run_now, script_params
from tests.kit import api_as, login

# No worker runs here: the API's own reads and writes stay in the test's transaction. The tests that
# execute a run mark themselves `committed` (the agent loop's ORM thread and ADK's engine read commits).
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_worker")]
committed = pytest.mark.django_db(transaction=True)



@pytest.fixture
def as_alice(alice):
    return api_as(alice)


@pytest.fixture
def as_lead(support_lead):
    return api_as(support_lead)



def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content[:500]
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert body["code"] == code, body
    assert isinstance(body["detail"], str) and body["detail"]
    return body


# --- Authentication ---------------------------------------------------------------------------------


def test_no_token_is_401_in_the_error_format():
    body = assert_error(APIClient().get("/api/runs/"), 401, "not_authenticated")
    assert "credentials" in body["detail"]


def test_a_bad_token_is_401():
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    assert_error(client.get("/api/runs/"), 401, "authentication_failed")


def test_session_authentication_works_for_the_admin_user(alice):
    client = APIClient()
    client.login(username="alice", password="alice-pass-123")
    assert client.get("/api/runs/").status_code == 200


def test_a_token_made_by_the_command_works(alice):
    call_command("drf_create_token", "alice")
    token = Token.objects.get(user=alice)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    assert client.get("/api/runs/").status_code == 200


# --- Create -------------------------------------------------------------------------------------------


def test_create_a_run_with_json(as_alice, alice):
    payload = {"agent": "support", "message": "Jane asks about her refund.", "owner_id": "jane",
               "params": {"script": [SEND_EMAIL, SAY_DONE]}}
    response = as_alice.post("/api/runs/", payload, format="json")

    assert response.status_code == 202, response.json()
    body = response.json()
    run = AgentRun.objects.get(pk=body["run_id"])
    assert response["Location"].endswith(f"/api/runs/{run.run_id}/")
    assert body["status"] == "queued"
    assert body["trigger"] == "api"
    assert body["created_by"] == "alice"
    assert body["config"] == {"message": payload["message"], "params": payload["params"]}
    assert "input_file" not in body
    assert run.created_by == alice


def test_create_a_run_with_a_file(as_alice, settings):
    content = b"invoice 42: 19.99 EUR\n"
    from django.core.files.uploadedfile import SimpleUploadedFile

    response = as_alice.post(
        "/api/runs/",
        {"agent": "support", "message": "read it", "owner_id": "jane",
         "params": json.dumps({"script": [SAY_DONE]}),
         "file": SimpleUploadedFile("invoice.txt", content, content_type="text/plain")},
        format="multipart",
    )
    assert response.status_code == 202, response.json()
    body = response.json()
    assert body["input_file_name"] == "invoice.txt"
    assert body["input_file_sha256"] == hashlib.sha256(content).hexdigest()
    assert body["input_file_size"] == len(content)
    assert body["config"]["params"] == {"script": [SAY_DONE]}
    assert str(settings.RUN_INPUTS_DIR) not in response.content.decode()


@pytest.mark.parametrize(
    "payload, field, words",
    [
        ({"agent": 5, "message": "hi", "owner_id": "jane"}, "agent", "Must be a string"),
        ({"agent": "support", "message": ["hi"], "owner_id": "jane"}, "message", "Must be a string"),
        ({"agent": "support", "message": "hi", "owner_id": None}, "owner_id", "may not be null"),
        ({"agent": "support", "message": "hi", "owner_id": "jane", "params": [1]}, "params", "JSON object"),
        ({"agent": "support", "message": "hi", "owner_id": "jane", "params": "{}"}, "params", "JSON object"),
        ({"agent": "support", "message": "hi", "owner_id": "jane", "priority": 1}, "priority", "Unknown field"),
        ({"message": "hi", "owner_id": "jane"}, "agent", "required"),
        ({"agent": "nope", "message": "hi", "owner_id": "jane"}, "agent", "no agent named 'nope'"),
        ({"agent": "support", "message": "  ", "owner_id": "jane"}, "message", "empty"),
        ({"agent": "support", "message": "hi", "owner_id": ""}, "owner_id", "required"),
        ({"agent": "support", "message": "hi", "owner_id": "jane", "params": {"script": [{"call": "rm"}]}},
         "params", "no tool named 'rm'"),
    ],
)
def test_bad_input_to_create_is_a_400_naming_the_field(as_alice, payload, field, words):
    body = assert_error(as_alice.post("/api/runs/", payload, format="json"), 400, "invalid")
    assert words in " ".join(body["errors"][field])
    assert field in body["detail"]
    assert AgentRun.objects.count() == 0


def test_a_list_instead_of_an_object_is_a_400(as_alice):
    body = assert_error(as_alice.post("/api/runs/", [1, 2], format="json"), 400, "invalid")
    assert "dictionary" in body["detail"]


@pytest.mark.parametrize("raw", [b"{not json", b'{"agent": "support",}', b"", b"NaN", b"\xff\xfe"])
def test_malformed_json_is_a_400(as_alice, raw):
    response = as_alice.generic("POST", "/api/runs/", raw, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["code"] in {"parse_error", "invalid"}


def test_an_unsupported_media_type_is_a_415(as_alice):
    response = as_alice.generic("POST", "/api/runs/", b"agent=support", content_type="text/plain")
    assert_error(response, 415, "unsupported_media_type")


def test_a_huge_json_body_is_a_413(as_alice, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    payload = {"agent": "support", "message": "x" * 20_000, "owner_id": "jane"}
    body = assert_error(as_alice.post("/api/runs/", payload, format="json"), 413, "request_too_large")
    assert "10000 bytes" in body["detail"]
    assert AgentRun.objects.count() == 0


def test_a_huge_upload_is_refused_before_it_is_read(as_alice, settings):
    from django.core.files.uploadedfile import SimpleUploadedFile

    settings.MAX_UPLOAD_BYTES = 1000
    from config.lib.limits import MULTIPART_OVERHEAD_BYTES

    big = SimpleUploadedFile("big.bin", b"x" * (MULTIPART_OVERHEAD_BYTES + 5000))
    response = as_alice.post(
        "/api/runs/", {"agent": "support", "message": "hi", "owner_id": "jane", "file": big}, format="multipart"
    )
    body = assert_error(response, 413, "request_too_large")
    assert "MAX_UPLOAD_BYTES" in body["detail"]


def test_an_upload_just_over_the_limit_is_a_413_and_leaves_nothing(as_alice, settings):
    from django.core.files.uploadedfile import SimpleUploadedFile

    settings.MAX_UPLOAD_BYTES = 1000
    response = as_alice.post(
        "/api/runs/",
        {"agent": "support", "message": "hi", "owner_id": "jane", "file": SimpleUploadedFile("a.bin", b"x" * 1001)},
        format="multipart",
    )
    body = assert_error(response, 413, "request_too_large")
    assert "MAX_UPLOAD_BYTES" in body["errors"]["file"][0]
    assert body["limit"] == 1000
    assert AgentRun.objects.count() == 0


def test_a_file_name_with_a_path_is_refused(as_alice):
    from django.core.files.uploadedfile import SimpleUploadedFile

    upload = SimpleUploadedFile("notes.txt", b"data")
    upload.name = "..secret"
    response = as_alice.post(
        "/api/runs/", {"agent": "support", "message": "hi", "owner_id": "jane", "file": upload}, format="multipart"
    )
    assert response.status_code == 400
    assert response.json()["code"] == "invalid"


def test_params_in_a_form_must_be_json(as_alice):
    response = as_alice.post(
        "/api/runs/", {"agent": "support", "message": "hi", "owner_id": "jane", "params": "{oops"}, format="multipart"
    )
    body = assert_error(response, 400, "invalid")
    assert "not valid JSON" in body["errors"]["params"][0]


# --- List, detail, visibility ---------------------------------------------------------------------------


def test_list_shows_only_my_runs_newest_first_and_staff_see_all(as_alice, as_lead, alice, bob):
    mine = [make_run(created_by=alice, tools=[]) for _ in range(3)]
    make_run(created_by=bob, tools=[])

    body = as_alice.get("/api/runs/").json()
    assert [r["run_id"] for r in body["results"]] == [str(r.run_id) for r in reversed(mine)]
    assert len(as_lead.get("/api/runs/").json()["results"]) == 4


def test_list_filters(as_alice, alice):
    failed = make_run(created_by=alice, status=RunStatus.ERROR, tools=[])
    ok = make_run(created_by=alice, status=RunStatus.SUCCESS, tools=[])
    replay = make_run(created_by=alice, status=RunStatus.QUEUED, tools=None)
    AgentRun.objects.filter(pk=replay.pk).update(replay_of=failed, owner_id="john", trigger="webhook")

    def ids(query):
        response = as_alice.get("/api/runs/", query)
        assert response.status_code == 200, response.json()
        return {r["run_id"] for r in response.json()["results"]}

    assert ids({"status": "success"}) == {str(ok.run_id)}
    assert ids({"replay_of": str(failed.run_id)}) == {str(replay.run_id)}
    assert ids({"owner_id": "john"}) == {str(replay.run_id)}
    assert ids({"trigger": "webhook"}) == {str(replay.run_id)}
    assert ids({"agent": "support", "status": "error"}) == {str(failed.run_id)}
    assert ids({"agent": "nobody"}) == set()


@pytest.mark.parametrize(
    "query, field", [({"status": "done"}, "status"), ({"trigger": "cron"}, "trigger"), ({"replay_of": "42"}, "replay_of")]
)
def test_bad_filters_are_a_400(as_alice, query, field):
    body = assert_error(as_alice.get("/api/runs/", query), 400, "invalid")
    assert field in body["errors"]


def test_cursor_pagination_walks_every_run_once(as_alice, alice):
    runs = {str(make_run(created_by=alice, tools=[]).run_id) for _ in range(5)}
    seen: list[str] = []
    url = "/api/runs/?page_size=2"
    while url:
        body = as_alice.get(url).json()
        seen.extend(r["run_id"] for r in body["results"])
        url = body["next"]
    assert sorted(seen) == sorted(runs) and len(seen) == 5

    assert_error(as_alice.get("/api/runs/?cursor=bogus"), 400, "invalid_cursor")


@committed
def test_detail_has_tool_calls_replays_and_the_current_decision(as_alice, alice):
    original = run_now(params=script_params(SEND_EMAIL, UPDATE_CRM, {"fail": "error", "message": "lost"}),
                       created_by=alice)
    body = as_alice.get(f"/api/runs/{original.run_id}/").json()

    assert body["status"] == "error"
    assert body["tools_executed"] == ["send_email", "update_crm"]
    assert [(c["seq"], c["tool_name"], c["status"], c["in_doubt"]) for c in body["tool_calls"]] == [
        (1, "send_email", "answered", False),
        (2, "update_crm", "answered", False),
    ]
    assert body["tool_calls"][0]["args"] == SEND_EMAIL["args"]
    assert body["replays"] == []
    assert body["replay_decision"] == {
        "allowed": False,
        "status": 409,
        "code": "tools_called",
        "detail": TOOLS_CALLED_API,
        "tools": ["send_email", "update_crm"],
        "force_would_replay": True,
        "preview": [
            {"seq": 1, "call_id": body["tool_calls"][0]["call_id"], "tool_name": "send_email",
             "effect": "idempotent", "reuse": "served from record", "redo": "runs again"},
            {"seq": 2, "call_id": body["tool_calls"][1]["call_id"], "tool_name": "update_crm",
             "effect": "idempotent", "reuse": "served from record", "redo": "runs again"},
        ],
    }
    assert [c["effect"] for c in body["tool_calls"]] == ["idempotent", "idempotent"]
    # Not a workflow run: no steps.
    assert body["steps"] == []


@pytest.mark.parametrize("status", ["queued", "running"])
def test_the_decision_of_a_run_in_flight_gives_the_http_status_and_names_the_runs_own(as_alice, alice, status):
    # The refusal's context names the run's status; it must not take the place of the HTTP status.
    run = make_run(status=status, created_by=alice, heartbeat_at=timezone.now())
    decision = as_alice.get(f"/api/runs/{run.run_id}/").json()["replay_decision"]
    assert decision["status"] == 409
    assert decision["code"] == "run_in_flight"
    assert decision["run_status"] == status
    # The replay request itself still names the run's status in its error body.
    refused = as_alice.post(f"/api/runs/{run.run_id}/replay/", {}, format="json")
    assert refused.status_code == 409 and refused.json()["status"] == status


def test_detail_lists_replays(as_lead, support_lead):
    original = make_run(tools=[])
    replay = services.replay_run(original.run_id, actor=support_lead)
    body = as_lead.get(f"/api/runs/{original.run_id}/").json()
    assert [r["run_id"] for r in body["replays"]] == [str(replay.run_id)]
    assert body["replay_decision"]["code"] == "replay_in_flight"
    assert body["replay_decision"]["replay_run_id"] == str(replay.run_id)
    assert as_lead.get(f"/api/runs/{replay.run_id}/").json()["replay_of"] == str(original.run_id)


@pytest.mark.parametrize(
    "method, suffix",
    [("get", ""), ("post", "replay/"), ("post", "cancel/"), ("get", "events/")],
)
def test_another_users_run_is_a_404_everywhere(as_alice, bob, method, suffix):
    theirs = make_run(created_by=bob, status=RunStatus.QUEUED)
    response = getattr(as_alice, method)(f"/api/runs/{theirs.run_id}/{suffix}", {}, format="json")
    assert_error(response, 404, "not_found")
    assert AgentRun.objects.count() == 1
    assert AgentRun.objects.get().status == RunStatus.QUEUED


def test_an_unknown_run_is_a_404(as_alice):
    assert_error(as_alice.get(f"/api/runs/{uuid.uuid4()}/"), 404, "not_found")
    assert_error(as_alice.get("/api/runs/not-a-uuid/"), 404, "not_found")


# --- Replay: every row of the table ----------------------------------------------------------------------


@pytest.mark.parametrize("state, code, status, force_code, force_status", TABLE)
def test_every_row_of_the_replay_table_through_the_api(as_lead, state, code, status, force_code, force_status):
    original = run_in_state(state)
    before = AgentRun.objects.filter(pk=original.pk).values().get()
    count = AgentRun.objects.count()

    response = as_lead.post(f"/api/runs/{original.run_id}/replay/", {"force": False, "reason": ""}, format="json")
    if code is None:
        assert response.status_code == 202, response.json()
        assert response.json()["replay_of"] == str(original.run_id)
        AgentRun.objects.filter(replay_of=original).delete()
    else:
        body = assert_error(response, status, code)
        assert AgentRun.objects.count() == count
        if code in {"run_succeeded", "already_replayed", "tools_called", "tools_unknown"}:
            assert body["detail"].endswith(API_HINT)
        if code == "tools_called":
            assert body["detail"] == TOOLS_CALLED_API
            assert body["tools"] == ["send_email", "update_crm"]
        if code == "tools_unknown":
            assert body["detail"] == TOOLS_UNKNOWN_API
        if code in {"replay_in_flight", "already_replayed"}:
            assert body["replay_run_id"] == str(original.replay_id)

    forced = as_lead.post(
        f"/api/runs/{original.run_id}/replay/", {"force": True, "reason": "Support ticket 7: resend"}, format="json"
    )
    if force_code is None:
        assert forced.status_code == 202, forced.json()
        new = forced.json()
        assert new["replay_of"] == str(original.run_id)
        assert new["forced"] is (code is not None)
        assert new["session_id"] != original.session_id
    else:
        assert_error(forced, force_status, force_code)
    assert AgentRun.objects.filter(pk=original.pk).values().get() == before


def test_force_without_the_permission_is_403(alice):
    run = make_run(created_by=alice, tools=["send_email"])
    body = assert_error(
        api_as(alice).post(f"/api/runs/{run.run_id}/replay/", {"force": True, "reason": "x"}, format="json"),
        403,
        "force_not_permitted",
    )
    assert "runs.force_replay_agentrun" in body["detail"]
    assert AgentRun.objects.count() == 1


@pytest.mark.parametrize("body", [{"force": True}, {"force": True, "reason": ""}, {"force": True, "reason": "   "}])
def test_force_without_a_reason_is_400(as_lead, body):
    run = make_run(tools=["send_email"])
    assert_error(as_lead.post(f"/api/runs/{run.run_id}/replay/", body, format="json"), 400, "reason_required")
    assert AgentRun.objects.count() == 1


@pytest.mark.parametrize(
    "body, field",
    [
        ({"force": "yes"}, "force"),
        ({"force": 1}, "force"),
        ({"force": True, "reason": 42}, "reason"),
        ({"force": True, "reason": "x" * 2001}, "reason"),
        ({"forse": True}, "forse"),
    ],
)
def test_bad_replay_bodies_are_400(as_lead, body, field):
    run = make_run(tools=["send_email"])
    response = as_lead.post(f"/api/runs/{run.run_id}/replay/", body, format="json")
    assert field in assert_error(response, 400, "invalid")["errors"]


def test_replay_with_an_empty_body_is_a_plain_replay(as_lead):
    run = make_run(tools=[])
    response = as_lead.generic("POST", f"/api/runs/{run.run_id}/replay/", b"", content_type="application/json")
    assert response.status_code == 202


def test_get_on_an_action_is_405(as_lead):
    run = make_run(tools=[])
    assert_error(as_lead.get(f"/api/runs/{run.run_id}/replay/"), 405, "method_not_allowed")
    assert_error(as_lead.delete(f"/api/runs/{run.run_id}/"), 405, "method_not_allowed")


# --- Cancel and events ---------------------------------------------------------------------------------


def test_cancel_through_the_api(as_alice, alice):
    run = make_run(created_by=alice, status=RunStatus.QUEUED)
    response = as_alice.post(f"/api/runs/{run.run_id}/cancel/")
    assert response.status_code == 202
    assert response.json()["status"] == "cancelled"
    assert response.json()["tools_executed"] == []
    assert response.json()["cancel_requested_by"] == "alice"

    body = assert_error(as_alice.post(f"/api/runs/{run.run_id}/cancel/"), 409, "run_settled")
    assert body["status"] == "cancelled"
    assert_error(as_alice.post(f"/api/runs/{run.run_id}/cancel/", {"now": True}, format="json"), 400, "invalid")


@committed
def test_events_tell_what_happened(as_alice, alice):
    import io

    run = run_now(
        params=script_params(SEND_EMAIL, {"fail": "error", "message": "backend down"}),
        created_by=alice,
        file=io.BytesIO(b"hello"),
        file_name="note.txt",
    )
    body = as_alice.get(f"/api/runs/{run.run_id}/events/").json()
    assert body["run_id"] == str(run.run_id)
    assert body["session_id"] == run.session_id
    events = body["events"]
    assert events[0]["author"] == "user"
    assert events[0]["text"] == run.message
    assert events[0]["attachments"] == [{"display_name": "note.txt", "mime_type": "text/plain", "size": 5}]
    assert "aGVsbG8" not in json.dumps(body)  # the base64 of the upload is never copied out
    calls = [c for e in events for c in e["function_calls"]]
    responses = [r for e in events for r in e["function_responses"]]
    assert [(c["name"], c["args"]) for c in calls] == [("send_email", SEND_EMAIL["args"])]
    assert responses[0]["name"] == "send_email" and responses[0]["response"]["status"] == "sent"
    assert any(e["error_code"] for e in events)


# --- Everything else is JSON too ------------------------------------------------------------------------


def test_unknown_api_paths_answer_json(as_alice):
    body = assert_error(as_alice.get("/api/nothing/here/"), 404, "not_found")
    assert "/api/nothing/here/" in body["detail"]
    body = assert_error(as_alice.post("/api/runs", {}, format="json"), 404, "not_found")
    assert "Did you mean /api/runs/" in body["detail"]


def test_a_server_error_is_json_under_the_api(as_alice, alice, monkeypatch):
    from runs.ledger import timeline

    def broken(run):
        raise RuntimeError("boom")

    monkeypatch.setattr(timeline, "run_events", broken)
    run = make_run(created_by=alice, tools=[])
    as_alice.raise_request_exception = False
    body = assert_error(as_alice.get(f"/api/runs/{run.run_id}/events/"), 500, "server_error")
    assert "boom" not in body["detail"]


def test_csrf_is_enforced_for_session_clients(alice):
    client = APIClient(enforce_csrf_checks=True)
    client.login(username="alice", password="alice-pass-123")
    assert_error(client.post("/api/runs/", {}, format="json"), 403, "permission_denied")


def test_the_schema_and_the_docs_page_are_served(alice):
    client = login(alice)
    schema = client.get("/api/schema/")
    assert schema.status_code == 200
    text = schema.content.decode()
    for fragment in ("/api/runs/{run_id}/replay/", "'409'", "'410'", "'403'", "force_would_replay"):
        assert fragment in text
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    assert b"swagger" in docs.content.lower()
    assert b"cdn." not in docs.content  # assets come from the sidecar package


def test_the_schema_validates_without_warnings(tmp_path):
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))
    assert "/api/runs/" in (tmp_path / "schema.yaml").read_text()


def test_admin_and_api_say_the_same_thing_apart_from_the_hint():
    run = make_run(tools=["send_email", "update_crm"])
    from runs.rules import replay as rules

    refusal = rules.decide(run, force=False).refusal
    assert refusal.admin_detail == refusal.detail.replace(API_HINT, ADMIN_HINT)


@pytest.mark.parametrize("suffix", ["replay/", "cancel/"])
@pytest.mark.parametrize(
    "raw, content_type, status, code",
    [
        (b"{oops", "application/json", 400, "parse_error"),
        (b"[true]", "application/json", 400, "invalid"),
        (b'"force"', "application/json", 400, "invalid"),
        (b"force=true", "text/plain", 415, "unsupported_media_type"),
        (b'{"reason": "' + b"x" * 20_000 + b'"}', "application/json", 413, "request_too_large"),
    ],
)
def test_bad_bodies_to_the_run_actions(as_lead, settings, suffix, raw, content_type, status, code):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    run = make_run(status=RunStatus.QUEUED)
    response = as_lead.generic("POST", f"/api/runs/{run.run_id}/{suffix}", raw, content_type=content_type)
    assert_error(response, status, code)
    assert AgentRun.objects.count() == 1
    assert AgentRun.objects.get().status == RunStatus.QUEUED
