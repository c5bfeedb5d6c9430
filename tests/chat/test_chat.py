"""Chat turns as runs, streamed as server-sent events by a live ASGI server over real HTTP."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import threading
import uuid
from pathlib import Path

import httpx
import pytest
from django.db import connection
from rest_framework.authtoken.models import Token

from agents import registry
from agents.models import AdkEvent, OutboxEmail
from runs.chat import turns as chat
from runs.execution import executor
from runs.management.commands.serve import web_command
from runs.models.chat import Conversation
from runs.models.ledger import AgentRun, RunStatus, ToolCallStatus, Trigger
from runs.services import run as services
from tests.helpers import (
    BASE_DIR,
    LOOKUP,
    SAY_DONE,
    SEND_EMAIL,
    child_env,
    script_params,
    wait_until,
    wait_until_serving,
)

# A live server (its own process) and the agent loop read what the test committed.
pytestmark = pytest.mark.django_db(transaction=True)

HANG = dict(SEND_EMAIL, hang=60)


# --- A live server on the test database -----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(django_db_setup, tmp_path_factory):
    """`manage.py serve`'s web process (uvicorn, ASGI), started on a free port."""
    port = _free_port()
    log_path = Path(tmp_path_factory.mktemp("server")) / "uvicorn.log"
    env = child_env(
        MODEL_RETRY_BASE_DELAY_SECONDS="0.01",
        CHAT_KEEPALIVE_SECONDS="0.5",
        RUN_HEARTBEAT_SECONDS="0.5",
        LOG_LEVEL="WARNING",
    )
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            web_command(host="127.0.0.1", port=port), cwd=BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(url, process, log_path)
    yield url
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture
def alice_token(alice) -> str:
    return Token.objects.create(user=alice).key


@pytest.fixture
def bob_token(bob) -> str:
    return Token.objects.create(user=bob).key


def _frames(response: httpx.Response, *, comments: bool = False):
    """Parse a server-sent event stream into (event, data) pairs; comments only if asked for."""
    event, data = None, []
    for line in response.iter_lines():
        if line == "":
            if event is not None:
                yield event, json.loads("\n".join(data))
            event, data = None, []
        elif line.startswith(":"):
            if comments:
                yield ":", line[1:].strip()
        elif line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            data.append(line[len("data: "):])


def _turn(server: str, token: str, **body) -> tuple[httpx.Response, list[tuple[str, dict]]]:
    body.setdefault("agent", "support")
    body.setdefault("owner_id", "jane")
    with httpx.Client(timeout=30) as client:
        with client.stream(
            "POST", f"{server}/api/chat/", json=body, headers={"Authorization": f"Token {token}"}
        ) as response:
            if response.headers["content-type"].startswith("application/json"):
                response.read()
                return response, []
            return response, list(_frames(response))


def _wait_settled(run_id: str, timeout: float = 20) -> AgentRun:
    def settled() -> AgentRun | None:
        run = AgentRun.objects.get(pk=run_id)
        return None if run.is_in_flight else run

    return wait_until(settled, timeout=timeout, what=f"run {run_id} to settle")


def _session_user_messages(session_id: str) -> list[str]:
    events = AdkEvent.objects.filter(session_id=session_id).order_by("timestamp")
    return [p["text"] for e in events if e.author == "user" for p in e.parts if "text" in p]


# --- Streaming --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_chat_turn_streams_its_events_then_its_outcome(server, alice, alice_token):
    response, frames = _turn(
        server, alice_token, message="Email Jane about her refund.", params=script_params(SEND_EMAIL, SAY_DONE)
    )

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    kinds = [kind for kind, _ in frames]
    assert kinds[0] == "run" and kinds[-1] == "done"
    assert set(kinds[1:-1]) == {"adk"}

    started, done = frames[0][1], frames[-1][1]
    events = [data for kind, data in frames if kind == "adk"]
    parts = [part for event in events for part in event["content"]["parts"]]
    assert parts[0]["functionCall"]["name"] == "send_email"
    assert parts[1]["functionResponse"]["name"] == "send_email"
    assert parts[2] == {"text": "Done."}
    assert all(event["invocationId"] == f"e-{started['run_id']}" for event in events)

    assert done["run_id"] == started["run_id"]
    assert done["status"] == "success"
    assert done["tools_executed"] == ["send_email"]
    assert done["result"] == "Done."

    run = AgentRun.objects.get(pk=done["run_id"])
    assert run.trigger == Trigger.CHAT
    assert run.created_by == alice
    assert run.status == RunStatus.SUCCESS
    assert run.conversation_id == started["conversation_id"] == response.headers["x-conversation-id"]
    conversation = Conversation.objects.get(pk=run.conversation_id)
    assert (conversation.created_by, conversation.owner_id, conversation.agent_name) == (alice, "jane", "support")
    assert run.session_id == conversation.session_id == started["session_id"]
    assert OutboxEmail.objects.filter(run_id=run.run_id).count() == 1


@pytest.mark.slow
def test_a_conversation_keeps_one_session_and_each_turn_counts_its_own_tools(server, alice_token):
    _, first = _turn(
        server,
        alice_token,
        message="Email Jane.",
        params=script_params(SEND_EMAIL, {"fail": "rate_limit"}, SAY_DONE),
    )
    first_done = first[-1][1]
    assert first_done["status"] == "success"
    assert first_done["tools_executed"] == ["send_email"]
    # The rate limit was retried at the model call inside the server, and recorded on the turn.
    assert [r["reason"] for r in first_done["model_retries"]] == ["rate_limit"]

    _, second = _turn(
        server,
        alice_token,
        message="Now look her up.",
        conversation_id=first_done["conversation_id"],
        params=script_params(LOOKUP, SAY_DONE),
    )
    second_done = second[-1][1]
    assert second_done["status"] == "success"
    assert second_done["conversation_id"] == first_done["conversation_id"]
    assert second_done["session_id"] == first_done["session_id"]
    assert second_done["tools_executed"] == ["lookup_customer"]

    assert _session_user_messages(first_done["session_id"]) == ["Email Jane.", "Now look her up."]
    assert OutboxEmail.objects.count() == 1


@pytest.mark.slow
def test_a_client_that_disconnects_cancels_its_run_and_the_server_keeps_serving(server, alice_token):
    with httpx.Client(timeout=30) as client:
        with client.stream(
            "POST",
            f"{server}/api/chat/",
            json={"agent": "support", "owner_id": "jane", "message": "Email Jane.", "params": script_params(HANG, SAY_DONE)},
            headers={"Authorization": f"Token {alice_token}"},
        ) as response:
            frames = _frames(response, comments=True)
            events = ((kind, data) for kind, data in frames if kind != ":")
            _, started = next(events)
            _, call = next(events)
            assert call["content"]["parts"][0]["functionCall"]["name"] == "send_email"

            # While the tool hangs, the same conversation refuses a second turn.
            busy, _ = _turn(
                server,
                alice_token,
                message="Are you done?",
                conversation_id=started["conversation_id"],
                params=script_params(SAY_DONE),
            )
            assert busy.status_code == 409
            assert busy.json()["code"] == "conversation_busy"
            assert busy.json()["run_id"] == started["run_id"]

            # The idle stream carries keepalive comments while the tool works.
            assert next(frames) == (":", "keepalive")
        # Leaving the blocks closes the connection in the middle of the stream.

    run = _wait_settled(started["run_id"])
    assert run.status == RunStatus.CANCELLED
    assert run.error_code == "client_disconnected"
    assert run.config["message"] == "Email Jane."
    assert run.tools_executed == ["send_email"]
    call_row = run.tool_calls.get()
    assert call_row.tool_name == "send_email"
    assert call_row.status == ToolCallStatus.FAILED  # sealed by the abort, not left dangling
    assert OutboxEmail.objects.count() == 0  # the hang came before the effect
    sealed = [
        e for e in AdkEvent.objects.filter(session_id=run.session_id) if e.data.get("error_code") == "INVOCATION_ABORTED"
    ]
    assert sealed

    # The server still serves, and the conversation takes its next turn in the same session.
    response, frames = _turn(
        server,
        alice_token,
        message="Try again.",
        conversation_id=started["conversation_id"],
        params=script_params(SEND_EMAIL, SAY_DONE),
    )
    assert response.status_code == 200
    assert frames[-1][1]["status"] == "success"
    assert frames[-1][1]["session_id"] == run.session_id
    assert OutboxEmail.objects.count() == 1


@pytest.mark.slow
def test_session_authentication_needs_the_csrf_token(server, client, alice):
    client.force_login(alice)
    session_cookie = client.cookies["sessionid"].value
    body = {"agent": "support", "owner_id": "jane", "message": "Hello", "params": script_params(SAY_DONE)}
    with httpx.Client(base_url=server, timeout=30) as http:
        http.cookies.set("sessionid", session_cookie)
        refused = http.post("/api/chat/", json=body)
        assert refused.status_code == 403
        assert refused.json()["code"] == "permission_denied"
        assert "CSRF" in refused.json()["detail"]

        http.get("/admin/login/")  # hands out the CSRF cookie
        with http.stream("POST", "/api/chat/", json=body, headers={"X-CSRFToken": http.cookies["csrftoken"]}) as ok:
            assert ok.status_code == 200
            frames = list(_frames(ok))
    assert frames[-1][1]["status"] == "success"
    assert AgentRun.objects.get(pk=frames[-1][1]["run_id"]).created_by == alice


@pytest.mark.slow
def test_bad_input_over_http_is_refused_before_any_stream(server, alice_token):
    response, frames = _turn(server, alice_token, agent="nobody", message="Hello")
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert response.json()["code"] == "invalid"
    assert "There is no agent named 'nobody'" in response.json()["errors"]["agent"][0]
    assert frames == []
    assert not AgentRun.objects.exists()


# --- Refusals before the stream (in-process client, same view) -------------------------------------


def _post(client, body, token=None, **extra):
    headers = {"HTTP_AUTHORIZATION": f"Token {token}"} if token else {}
    data = body if isinstance(body, str) else json.dumps(body)
    return client.post("/api/chat/", data=data, content_type="application/json", **headers, **extra)


VALID = {"agent": "support", "owner_id": "jane", "message": "Hello"}


@pytest.mark.parametrize(
    "body, field, words",
    [
        (dict(VALID, agent="nobody"), "agent", "There is no agent named 'nobody'"),
        ({"owner_id": "jane", "message": "Hello"}, "agent", "agent is required"),
        (dict(VALID, message=""), "message", "The message is empty"),
        (dict(VALID, message="   "), "message", "The message is empty"),
        ({"agent": "support", "message": "Hello"}, "owner_id", "owner_id is required"),
        (dict(VALID, params=[1]), "params", "params must be a JSON object"),
        (dict(VALID, params={"script": [{"call": "launch_rockets"}]}), "params", "no tool named 'launch_rockets'"),
        (dict(VALID, conversation_id="not-a-uuid"), "conversation_id", "is not a conversation id"),
        (dict(VALID, colour="blue"), "body", "Unknown field(s): colour"),
        ("{not json", "body", "must be a JSON object"),
        ("[1, 2]", "body", "must be a JSON object"),
    ],
)
def test_bad_input_is_a_400_naming_the_problem(client, alice_token, body, field, words):
    response = _post(client, body, alice_token)

    assert response.status_code == 400
    assert not response.streaming
    payload = response.json()
    assert payload["code"] == "invalid"
    assert words in " ".join(payload["errors"][field])
    assert words in payload["detail"]
    assert not AgentRun.objects.exists()
    assert not Conversation.objects.exists()


def test_no_credentials_is_a_401(client):
    response = _post(client, VALID)
    assert response.status_code == 401
    assert response.json() == {"code": "not_authenticated", "detail": "Authentication credentials were not provided."}
    assert response["WWW-Authenticate"] == "Token"


@pytest.mark.parametrize("header", ["Token nonsense", "Token", "Token a b"])
def test_a_bad_token_is_a_401(client, header):
    response = client.post("/api/chat/", data=json.dumps(VALID), content_type="application/json", HTTP_AUTHORIZATION=header)
    assert response.status_code == 401
    assert response.json()["code"] == "authentication_failed"


def test_an_inactive_users_token_is_a_401(client, alice, alice_token):
    alice.is_active = False
    alice.save()
    response = _post(client, VALID, alice_token)
    assert response.status_code == 401
    assert response.json()["detail"] == "User inactive or deleted."


def test_only_post_is_allowed(client, alice_token):
    response = client.get("/api/chat/", HTTP_AUTHORIZATION=f"Token {alice_token}")
    assert response.status_code == 405
    assert response.json()["code"] == "method_not_allowed"


def _conversation(user, *, agent="support", owner="jane") -> Conversation:
    return Conversation.objects.create(agent_name=agent, owner_id=owner, created_by=user, session_id=str(uuid.uuid4()))


def test_someone_elses_conversation_is_a_404(client, alice_token, bob):
    bobs = _conversation(bob)
    response = _post(client, dict(VALID, conversation_id=str(bobs.pk)), alice_token)

    assert response.status_code == 404
    assert response.json()["code"] == "conversation_not_found"
    assert not AgentRun.objects.exists()


@pytest.mark.parametrize(
    "changes", [{"owner_id": "john"}, {"agent": "other"}, {"conversation_id": str(uuid.uuid4())}]
)
def test_a_conversation_is_found_only_for_its_owner_and_agent(client, alice, alice_token, changes, monkeypatch):
    monkeypatch.setitem(registry.AGENTS, "other", dataclasses.replace(registry.get_agent_spec("support"), name="other"))
    mine = _conversation(alice)
    body = {**VALID, "conversation_id": str(mine.pk), **changes}
    response = _post(client, body, alice_token)
    assert response.status_code == 404
    assert response.json()["code"] == "conversation_not_found"
    assert not AgentRun.objects.exists()


def test_a_second_turn_while_one_runs_is_a_409(client, alice, alice_token):
    mine = _conversation(alice)
    running = services.start_run(
        agent_name="support", message="First", owner_id="jane", trigger=Trigger.CHAT,
        conversation_id=str(mine.pk), session_id=mine.session_id, enqueue=False, created_by=alice,
    )
    response = _post(client, dict(VALID, conversation_id=str(mine.pk)), alice_token)

    assert response.status_code == 409
    assert response.json()["code"] == "conversation_busy"
    assert response.json()["run_id"] == str(running.run_id)
    assert AgentRun.objects.count() == 1


def test_two_simultaneous_turns_on_one_conversation_start_one_run(alice):
    mine = _conversation(alice)
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def send() -> None:
        try:
            barrier.wait()
            chat.begin_turn(
                user=alice, agent_name="support", owner_id="jane", message="Hi", conversation_id=str(mine.pk)
            )
            outcomes.append("started")
        except chat.ConversationBusy:
            outcomes.append("busy")
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(outcomes) == ["busy", "started"]
    assert AgentRun.objects.filter(conversation_id=str(mine.pk)).count() == 1


# --- Replays stay out of the conversation --------------------------------------------------------


def test_a_replay_shaped_run_of_a_chat_turn_uses_its_own_session_and_leaves_the_conversation_alone(alice):
    """A replay as the replay rules shape it (same input and trigger, `replay_of`, a fresh
    session): it runs in its own session, and it does not occupy the conversation."""
    turn = chat.begin_turn(user=alice, agent_name="support", owner_id="jane", message="Email Jane.",
                           params=script_params(SEND_EMAIL, SAY_DONE))
    executor.execute(turn.run_id)
    turn.refresh_from_db()
    conversation_events = AdkEvent.objects.filter(session_id=turn.session_id).count()

    replay = services.start_run(
        agent_name=turn.agent_name, message=turn.message, owner_id=turn.owner_id, params=turn.params,
        created_by=alice, trigger=turn.trigger, conversation_id=turn.conversation_id, enqueue=False,
    )
    AgentRun.objects.filter(pk=replay.run_id).update(replay_of=turn)
    assert replay.session_id != turn.session_id

    # While the replay is queued, the conversation still takes a turn.
    next_turn = chat.begin_turn(user=alice, agent_name="support", owner_id="jane", message="Thanks.",
                                conversation_id=turn.conversation_id, params=script_params(SAY_DONE))
    assert next_turn.session_id == turn.session_id

    executor.execute(replay.run_id)
    replay.refresh_from_db()
    assert replay.status == RunStatus.SUCCESS
    assert AdkEvent.objects.filter(session_id=turn.session_id).count() == conversation_events
    assert _session_user_messages(replay.session_id) == ["Email Jane."]


def test_a_body_over_the_upload_limit_is_a_413(client, alice_token, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    response = _post(client, dict(VALID, message="x" * 2000), alice_token)
    assert response.status_code == 413
    assert response.json()["code"] == "request_too_large"
    assert not AgentRun.objects.exists()
