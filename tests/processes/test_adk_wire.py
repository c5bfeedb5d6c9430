"""ADK's API server wire under /adk/, against a live ASGI server, driven as ADK's docs drive `adk api_server`.

Every /run and /run_sse is a ledger run (trigger `adk`) in the client's session; a confirmation is
answered the ADK way (a function response for `adk_request_confirmation` in the next /run_sse) and
that answer is the decision; sessions are the owner's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from django.contrib.auth.models import Permission
from rest_framework.authtoken.models import Token

from agents.models import AdkEvent, OutboxEmail, Refund
from runs.management.commands.serve import web_command
from runs.models.approvals import Decision, PendingCall
from runs.models.ledger import AgentRun, RunStatus, Trigger
from tests import helpers
from tests.chat.test_chat import _free_port
from tests.helpers import BASE_DIR, LOOKUP, SAY_DONE, SEND_EMAIL, child_env, wait_until, wait_until_serving

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

BIG_REFUND = {"call": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 25_000}}
REFUNDED = {"say": "Refunded order A-1001."}
HANG = dict(SEND_EMAIL, hang=60)


def start_workers(log_path: Path) -> subprocess.Popen:
    """The ledger's workers (`runworker`), which continue a run once its waiting calls are answered."""
    return helpers.start_workers(log_path, processes=1, RUN_POLL_SECONDS="0.1", LOG_LEVEL="WARNING")


def stop(process: subprocess.Popen) -> None:
    if process.args[:3] == [sys.executable, "manage.py", "runworker"]:
        helpers.stop_group(process)  # the runworker and its processes
        return
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def server(django_db_setup, tmp_path_factory):
    """`manage.py serve`'s web process (uvicorn, ASGI) and the workers, on the test database."""
    port = _free_port()
    logs = Path(tmp_path_factory.mktemp("adkwire"))
    # The wire's client answers its own run's confirmations here: a deployment that lets a starter approve.
    env = child_env(CHAT_KEEPALIVE_SECONDS="0.5", RUN_HEARTBEAT_SECONDS="0.5", LOG_LEVEL="WARNING",
                    APPROVAL_BY_STARTER_ALLOWED="true")
    with open(logs / "uvicorn.log", "wb") as log:
        web = subprocess.Popen(web_command(host="127.0.0.1", port=port), cwd=BASE_DIR, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(url, web, logs / "uvicorn.log")
    workers = start_workers(logs / "workers.log")
    yield url
    stop(workers)
    stop(web)


@pytest.fixture
def alice_client(server, alice):
    """An ADK client pointed at the ledger's prefix, with alice's token; alice may approve calls."""
    alice.user_permissions.add(Permission.objects.get(codename="approve_toolcall"))
    key = Token.objects.create(user=alice).key
    with httpx.Client(base_url=f"{server}/adk", headers={"Authorization": f"Token {key}"}, timeout=60) as client:
        yield client


@pytest.fixture
def bob_client(server, bob):
    key = Token.objects.create(user=bob).key
    with httpx.Client(base_url=f"{server}/adk", headers={"Authorization": f"Token {key}"}, timeout=60) as client:
        yield client


def sse_events(response: httpx.Response) -> list[dict]:
    """The `data:` lines of ADK's stream, as ADK's clients read them."""
    return [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]


def run_sse(client: httpx.Client, body: dict) -> tuple[httpx.Response, list[dict]]:
    with client.stream("POST", "/run_sse", json=body) as response:
        if not response.headers["content-type"].startswith("text/event-stream"):
            response.read()
            return response, []
        return response, sse_events(response)


def message(text: str) -> dict:
    return {"role": "user", "parts": [{"text": text}]}


def function_calls(events: list[dict]) -> list[dict]:
    return [part["functionCall"] for event in events for part in event.get("content", {}).get("parts", [])
            if "functionCall" in part]


def texts(events: list[dict]) -> list[str]:
    return [part["text"] for event in events for part in event.get("content", {}).get("parts", []) if "text" in part]


# --- ADK's documented api_server sequence ------------------------------------------------------------------


def test_adks_documented_sequence_works_against_the_ledger_and_each_run_is_a_ledger_run(alice_client):
    assert "support" in alice_client.get("/list-apps").json()

    created = alice_client.post("/apps/support/users/jane/sessions/s_123", json={"visit_count": 5})
    assert created.status_code == 200, created.text
    assert (created.json()["id"], created.json()["appName"], created.json()["userId"]) == ("s_123", "support", "jane")
    assert created.json()["state"] == {"visit_count": 5}

    # /run with ADK's body in camelCase, the run's script through custom_metadata.params.
    ran = alice_client.post("/run", json={
        "appName": "support", "userId": "jane", "sessionId": "s_123",
        "newMessage": message("Email Jane about her refund."),
        "customMetadata": {"params": {"script": [SEND_EMAIL, SAY_DONE]}},
    })
    assert ran.status_code == 200, ran.text
    events = ran.json()
    assert [call["name"] for call in function_calls(events)] == ["send_email"]
    assert texts(events)[-1] == "Done."
    first = AgentRun.objects.get(pk=ran.headers["X-Run-Id"])
    assert (first.trigger, first.status, first.session_id, first.owner_id) == (Trigger.ADK, RunStatus.SUCCESS, "s_123", "jane")
    assert first.tools_executed == ["send_email"]
    assert all(event["invocationId"] == first.invocation_id for event in events)

    # /run_sse with snake_case, in the same session: the second turn sees the first.
    response, streamed = run_sse(alice_client, {
        "app_name": "support", "user_id": "jane", "session_id": "s_123", "new_message": message("Thanks!"),
        "streaming": False, "custom_metadata": {"params": {"script": [SAY_DONE]}},
    })
    assert response.status_code == 200
    assert texts(streamed) == ["Done."]
    second = AgentRun.objects.get(pk=response.headers["X-Run-Id"])
    assert (second.trigger, second.status, second.session_id) == (Trigger.ADK, RunStatus.SUCCESS, "s_123")

    session = alice_client.get("/apps/support/users/jane/sessions/s_123").json()
    said = [part.get("text") for event in session["events"] if event["author"] == "user"
            for part in event["content"]["parts"]]
    assert said == ["Email Jane about her refund.", "Thanks!"]
    assert {session["id"] for session in alice_client.get("/apps/support/users/jane/sessions").json()} >= {"s_123"}
    assert OutboxEmail.objects.count() == 1


def test_a_session_created_with_events_or_holding_evidence_is_refused_in_adks_shape(alice_client):
    refused = alice_client.post("/apps/support/users/jane/sessions", json={
        "events": [{"author": "user", "content": message("hi")}],
    })
    assert refused.status_code == 400
    assert "only runs write them" in refused.json()["detail"]

    sid = alice_client.post("/apps/support/users/jane/sessions", json={}).json()["id"]
    ran = alice_client.post("/run", json={"app_name": "support", "user_id": "jane", "session_id": sid,
                                          "new_message": message("Hello"),
                                          "custom_metadata": {"params": {"script": [SAY_DONE]}}})
    assert ran.status_code == 200, ran.text
    kept = alice_client.delete(f"/apps/support/users/jane/sessions/{sid}")
    assert kept.status_code == 409
    assert ran.headers["X-Run-Id"] in kept.json()["detail"]

    empty = alice_client.post("/apps/support/users/jane/sessions").json()["id"]
    assert alice_client.delete(f"/apps/support/users/jane/sessions/{empty}").status_code == 200
    assert alice_client.get(f"/apps/support/users/jane/sessions/{empty}").status_code == 404

    bad = alice_client.post("/run", json={"app_name": "support", "session_id": sid})
    assert bad.status_code == 422
    assert any(error["loc"][-1] in ("user_id", "userId") for error in bad.json()["detail"])
    assert alice_client.post("/run", json={"app_name": "nope", "user_id": "jane", "session_id": sid,
                                           "new_message": message("x")}).status_code == 404
    assert alice_client.get("/no-such-route").json() == {"detail": "Not Found", "code": "not_found"}
    assert alice_client.post("/run", content=b"{").status_code == 422


def test_another_owners_session_is_not_found(alice_client, bob_client):
    sid = alice_client.post("/apps/support/users/jane/sessions").json()["id"]
    assert bob_client.get(f"/apps/support/users/jane/sessions/{sid}").status_code == 404
    assert bob_client.get("/apps/support/users/jane/sessions").status_code == 404
    refused = bob_client.post("/run", json={"app_name": "support", "user_id": "jane", "session_id": sid,
                                            "new_message": message("Hello")})
    assert refused.status_code == 404
    assert refused.json()["detail"] == f"Session not found: {sid}"
    # Bob's own owner works; no token at all is a 401.
    assert bob_client.post("/apps/support/users/bob/sessions").status_code == 200
    assert httpx.get(f"{str(bob_client.base_url).rstrip('/')}/list-apps").status_code == 401
    assert AgentRun.objects.count() == 0


# --- A confirmation, answered the ADK way ---------------------------------------------------------------------


def test_a_confirmation_answered_over_run_sse_continues_the_same_run_and_the_effect_happens_once(alice_client):
    sid = alice_client.post("/apps/support/users/jane/sessions").json()["id"]
    body = {"app_name": "support", "user_id": "jane", "session_id": sid}
    response, asked = run_sse(alice_client, {**body, "new_message": message("Refund order A-1001."),
                                             "custom_metadata": {"params": {"script": [BIG_REFUND, REFUNDED]}}})
    assert response.status_code == 200
    # The stream ends as ADK's does: with its confirmation request.
    request = function_calls(asked)[-1]
    assert request["name"] == "adk_request_confirmation"
    assert request["args"]["originalFunctionCall"]["name"] == "issue_refund"
    run_id = response.headers["X-Run-Id"]
    run = wait_until(lambda: AgentRun.objects.filter(pk=run_id, status=RunStatus.WAITING).first(), timeout=20,
                     what="the run to wait")
    assert Refund.objects.count() == 0

    # A new message while it waits is refused, naming what to answer.
    busy = alice_client.post("/run", json={**body, "new_message": message("Hello?")})
    assert busy.status_code == 409
    assert "adk_request_confirmation" in busy.json()["detail"]

    answer = {"role": "user", "parts": [{"functionResponse": {
        "id": request["id"], "name": "adk_request_confirmation", "response": {"confirmed": True},
    }}]}
    response, went_on = run_sse(alice_client, {**body, "new_message": answer})
    assert response.status_code == 200, response.text
    assert response.headers["X-Run-Id"] == run_id
    assert texts(went_on)[-1] == "Refunded order A-1001."
    run.refresh_from_db()
    assert (run.status, run.attempts) == (RunStatus.SUCCESS, 2)
    assert Refund.objects.count() == 1
    decided = PendingCall.objects.get(run_id=run_id)
    assert (decided.decision, decided.decided_by.username) == (Decision.APPROVE, "alice")

    # Used once: the same answer again finds nothing waiting.
    again, _ = run_sse(alice_client, {**body, "new_message": answer})
    assert again.status_code == 409
    assert Refund.objects.count() == 1


def test_an_answer_from_someone_not_allowed_to_decide_is_refused(server, alice, bob_client):
    alice_key = Token.objects.create(user=alice).key
    with httpx.Client(base_url=f"{server}/adk", headers={"Authorization": f"Token {alice_key}"}, timeout=60) as alice_client:
        sid = alice_client.post("/apps/support/users/bob/sessions").json()["id"]
        body = {"app_name": "support", "user_id": "bob", "session_id": sid}
        response, asked = run_sse(alice_client, {**body, "new_message": message("Refund order A-1001."),
                                                 "custom_metadata": {"params": {"script": [BIG_REFUND, REFUNDED]}}})
        request = function_calls(asked)[-1]
        wait_until(lambda: AgentRun.objects.filter(pk=response.headers["X-Run-Id"], status=RunStatus.WAITING).first(),
                   timeout=20, what="the run to wait")
        answer = {"role": "user", "parts": [{"functionResponse": {
            "id": request["id"], "name": "adk_request_confirmation", "response": {"confirmed": True}}}]}
        # Alice may act for bob but not decide: the decision API's own refusal, in ADK's shape.
        refused = alice_client.post("/run", json={**body, "new_message": answer})
    assert refused.status_code == 403
    assert refused.json()["detail"]
    assert PendingCall.objects.get(run_id=response.headers["X-Run-Id"]).decision == ""
    assert Refund.objects.count() == 0


# --- A client that leaves ------------------------------------------------------------------------------------


def test_a_client_that_disconnects_cancels_its_run(alice_client):
    sid = alice_client.post("/apps/support/users/jane/sessions").json()["id"]
    with alice_client.stream("POST", "/run_sse", json={
        "app_name": "support", "user_id": "jane", "session_id": sid, "new_message": message("Email Jane."),
        "custom_metadata": {"params": {"script": [LOOKUP, HANG, SAY_DONE]}},
    }) as response:
        run_id = response.headers["X-Run-Id"]
        for line in response.iter_lines():
            if line.startswith("data: ") and "functionResponse" in line:
                # The lookup answered and the email hangs: a second message in the session is refused.
                busy = alice_client.post("/run", json={"app_name": "support", "user_id": "jane", "session_id": sid,
                                                       "new_message": message("Hello?")})
                assert busy.status_code == 409
                assert busy.json()["code"] == "session_busy" and run_id in busy.json()["detail"]
                break  # leave
    run = wait_until(lambda: AgentRun.objects.filter(pk=run_id, status=RunStatus.CANCELLED).first(), timeout=30,
                     what="the run to be cancelled")
    assert run.tools_executed == ["lookup_customer", "send_email"]
    assert AdkEvent.objects.filter(session_id=sid).exists()


def test_a_turn_in_a_missing_session_writes_nothing(alice_client):
    missing = str(uuid.uuid4())
    refused = alice_client.post("/run", json={"app_name": "support", "user_id": "jane", "session_id": missing,
                                              "new_message": message("Hello")})
    assert refused.status_code == 404
    assert refused.json()["detail"] == f"Session not found: {missing}"
    assert AgentRun.objects.count() == 0


def test_a_message_with_a_base64_file_is_the_runs_input_file_and_patch_is_refused(alice_client):
    import base64
    import hashlib

    sid = alice_client.post("/apps/support/users/jane/sessions").json()["id"]
    data = b"\x89PNG\r\n\x1a\n not really an image"
    ran = alice_client.post("/run", json={
        "appName": "support", "userId": "jane", "sessionId": sid, "streaming": False,
        "newMessage": {"role": "user", "parts": [
            {"text": "Describe this image"},
            {"inlineData": {"displayName": "my_image.png", "data": base64.b64encode(data).decode(),
                            "mimeType": "image/png"}},
        ]},
        "customMetadata": {"params": {"script": [SAY_DONE]}},
    })
    assert ran.status_code == 200, ran.text
    run = AgentRun.objects.get(pk=ran.headers["X-Run-Id"])
    assert (run.input_file_name, run.input_file_sha256) == ("my_image.png", hashlib.sha256(data).hexdigest())
    patched = alice_client.patch(f"/apps/support/users/jane/sessions/{sid}", json={"stateDelta": {"a": 1}})
    assert patched.status_code == 405
    assert "only through its runs" in patched.json()["detail"]


@pytest.mark.parametrize("body", [
    b"not json",
    b'{"app_name": "support", "user_id": "jane", "session_id": "s", "new_message": {"parts": [{"text": NaN}]}}',
    b"[" * 200 + b"]" * 200,
    b'{"app_name": "support", "user_id": "jane\\u0000", "session_id": "s", "new_message": {"parts": [{"text": "x"}]}}',
    b'{"app_name": "support", "user_id": "jane", "session_id": "\\ud800", "new_message": {"parts": [{"text": "x"}]}}',
    b'{"app_name": "support", "user_id": "jane", "session_id": "s", "new_message": {"parts": []}}',
    b'{"app_name": null, "user_id": "jane", "session_id": "s", "new_message": {"parts": [{"text": "x"}]}}',
    b'{"app_name": "support", "user_id": "jane", "session_id": "s", "new_message": {"parts": [{"text": "x"}]}, '
    b'"state_delta": {"a": 1}}',
    b'{"app_name": "support", "user_id": "jane", "session_id": "s", "new_message": {"parts": [{"text": "x"}]}, '
    b'"custom_metadata": {"trace": "t"}}',
])
def test_bad_input_gets_adks_error_shape_naming_the_problem_and_writes_nothing(alice_client, body):
    alice_client.post("/apps/support/users/jane/sessions/s")
    for path in ("/run", "/run_sse"):
        refused = alice_client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert 400 <= refused.status_code < 500, refused.text
        assert refused.json()["detail"]
    assert AgentRun.objects.count() == 0
