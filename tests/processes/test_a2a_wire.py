"""A2A against a live server, with the a2a-sdk's own client and ADK's RemoteA2aAgent: the ledger is the task store.

A task is a run (trigger `a2a`, executed by a worker); `tasks/get` answers from the run, a task
that waits for an approval is `input-required` and answered by an A2A message holding the function
response for `adk_request_confirmation`, as ADK's converters write it.
"""

from __future__ import annotations

import asyncio
import subprocess
import uuid

import httpx
import pytest
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    TaskState,
)
from django.contrib.auth.models import Permission
from google.adk.a2a import _compat
from rest_framework.authtoken.models import Token

from agents.models import OutboxEmail, Refund
from runs.management.commands.serve import web_command
from runs.models.approvals import Decision, PendingCall
from runs.models.ledger import AgentRun, RunStatus, Trigger
from tests.chat.test_chat import _free_port
from tests.helpers import (
    BASE_DIR,
    LOOKUP,
    SAY_DONE,
    SEND_EMAIL,
    child_env,
    stop_group,
    wait_until,
    wait_until_serving,
)
from tests.processes.test_adk_wire import BIG_REFUND, REFUNDED, server, start_workers, stop  # noqa: F401 - the live server

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

HANG = dict(SEND_EMAIL, hang=60)


def key_of(user) -> str:
    return Token.objects.create(user=user).key


async def a2a_client(server: str, key: str, *, streaming: bool = False, agent: str = "support"):  # noqa: F811
    http = httpx.AsyncClient(headers={"Authorization": f"Token {key}"}, timeout=60)
    card = await A2ACardResolver(http, base_url=f"{server}/a2a/{agent}").get_agent_card()
    return http, ClientFactory(ClientConfig(httpx_client=http, streaming=streaming)).create(card)


def user_message(text: str, *, params: dict | None = None, **fields) -> Message:
    message = Message(message_id=str(uuid.uuid4()), role=Role.ROLE_USER, parts=[Part(text=text)], **fields)
    if params is not None:
        _compat.set_struct_metadata(message, {"params": params, "owner_id": "jane"})
    return message


async def send(client, message: Message, *, return_immediately: bool = False) -> list:
    request = SendMessageRequest(message=message)
    request.configuration.return_immediately = return_immediately
    return [item async for item in client.send_message(request)]


def run_in(async_fn, *args):
    return asyncio.run(async_fn(*args))


def test_the_card_says_where_and_how_to_authenticate(server, alice):  # noqa: F811
    card = httpx.get(f"{server}/a2a/support/.well-known/agent-card.json").json()
    assert card["name"] == "support"
    assert card["supportedInterfaces"][0]["url"] == f"{server}/a2a/support"
    assert "ledgerToken" in card["securitySchemes"]
    assert httpx.get(f"{server}/a2a/nope/.well-known/agent-card.json").status_code == 404
    assert httpx.get(f"{server}/a2a/support/.well-known/agent-card.json",
                     headers={"Host": "evil.example"}).status_code == 400
    refused = httpx.post(f"{server}/a2a/support", json={"jsonrpc": "2.0", "id": 1, "method": "message/send"})
    assert refused.status_code == 401
    assert "Authorization: Token" in refused.json()["error"]["message"]


def test_send_get_and_stream_with_the_a2a_sdk_client_each_a_ledger_run(server, alice):  # noqa: F811
    key = key_of(alice)

    async def scenario():
        http, client = await a2a_client(server, key)
        sent = await send(client, user_message("Email Jane.", params={"script": [SEND_EMAIL, SAY_DONE]}))
        task = sent[-1].task
        fetched = await client.get_task(GetTaskRequest(id=task.id))
        await http.aclose()
        http, streaming = await a2a_client(server, key, streaming=True)
        streamed = await send(streaming, user_message("Look Jane up.", params={"script": [LOOKUP, SAY_DONE]},
                                                      context_id=task.context_id))
        await http.aclose()
        return task, fetched, streamed

    task, fetched, streamed = run_in(scenario)
    assert task.status.state == TaskState.TASK_STATE_COMPLETED
    assert task.artifacts[0].parts[0].text == "Done."
    run = AgentRun.objects.get(pk=task.id)
    assert (run.trigger, run.status, run.owner_id, run.session_id) == (Trigger.A2A, RunStatus.SUCCESS, "jane", task.context_id)
    assert run.tools_executed == ["send_email"]
    assert fetched.status.state == TaskState.TASK_STATE_COMPLETED and fetched.id == task.id

    kinds = [item.WhichOneof("payload") for item in streamed]
    assert kinds[0] == "task" and kinds[-1] == "status_update"
    assert streamed[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED
    assert "artifact_update" in kinds
    second = AgentRun.objects.get(pk=streamed[0].task.id)
    # The same context is the same session: the conversation goes on.
    assert (second.session_id, second.status) == (task.context_id, RunStatus.SUCCESS)
    assert OutboxEmail.objects.count() == 1


def test_another_owners_task_is_not_found_and_cancel_cancels_the_run(server, alice, bob):  # noqa: F811
    alice_key, bob_key = key_of(alice), key_of(bob)

    async def scenario():
        http, client = await a2a_client(server, alice_key)
        started = (await send(client, user_message("Email Jane.", params={"script": [LOOKUP, HANG, SAY_DONE]}),
                              return_immediately=True))[-1].task
        bob_http, bob_client = await a2a_client(server, bob_key)
        with pytest.raises(Exception) as hidden:
            await bob_client.get_task(GetTaskRequest(id=started.id))
        await bob_http.aclose()
        await asyncio.to_thread(wait_until, lambda: OutboxEmail.objects.none().exists() or AgentRun.objects.filter(
            pk=started.id, status=RunStatus.RUNNING).exists(), timeout=30, what="the run to start")
        canceled = await client.cancel_task(CancelTaskRequest(id=started.id))
        await http.aclose()
        return started, hidden.value, canceled

    started, hidden, canceled = run_in(scenario)
    assert started.status.state == TaskState.TASK_STATE_WORKING
    assert "There is no task" in str(hidden)
    assert canceled.status.state == TaskState.TASK_STATE_CANCELED
    assert AgentRun.objects.get(pk=started.id).status == RunStatus.CANCELLED


def test_input_required_answered_over_a2a_continues_the_same_run_and_the_effect_happens_once(server, alice):  # noqa: F811
    alice.user_permissions.add(Permission.objects.get(codename="approve_toolcall"))
    key = key_of(alice)

    async def scenario():
        http, client = await a2a_client(server, key)
        waiting = (await send(client, user_message("Refund A-1001.", params={"script": [BIG_REFUND, REFUNDED]})))[-1].task
        asked = [_compat.data_part_dict(part) for part in waiting.status.message.parts if _compat.is_data_part(part)]
        answer = Message(message_id=str(uuid.uuid4()), role=Role.ROLE_USER, task_id=waiting.id,
                         context_id=waiting.context_id, parts=[_compat.make_data_part(
                             data={"id": asked[0]["id"], "name": "adk_request_confirmation",
                                   "response": {"confirmed": True}},
                             metadata={"adk_type": "function_response"})])
        done = (await send(client, answer))[-1].task
        await http.aclose()
        return waiting, asked, done

    waiting, asked, done = run_in(scenario)
    assert waiting.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    assert asked[0]["name"] == "adk_request_confirmation"
    assert asked[0]["args"]["originalFunctionCall"]["name"] == "issue_refund"
    assert (done.id, done.status.state) == (waiting.id, TaskState.TASK_STATE_COMPLETED)
    assert done.artifacts[0].parts[0].text == "Refunded order A-1001."
    run = AgentRun.objects.get(pk=done.id)
    assert (run.status, run.attempts) == (RunStatus.SUCCESS, 2)
    assert PendingCall.objects.get(run_id=run.run_id).decision == Decision.APPROVE
    assert Refund.objects.count() == 1


def test_an_adk_agent_calls_a_ledger_agent_through_remote_a2a_agent(server, alice):  # noqa: F811
    from google.adk.agents import SequentialAgent
    from google.adk.agents.remote_a2a_agent import RemoteA2aAgent
    from google.adk.runners import InMemoryRunner
    from google.genai import types

    key = key_of(alice)

    async def scenario():
        http = httpx.AsyncClient(headers={"Authorization": f"Token {key}"}, timeout=60)
        remote = RemoteA2aAgent(
            name="ledger_support", agent_card=f"{server}/a2a/support/.well-known/agent-card.json", httpx_client=http,
        )
        root = SequentialAgent(name="front_desk", sub_agents=[remote])
        runner = InMemoryRunner(agent=root, app_name="front_desk")
        session = await runner.session_service.create_session(app_name="front_desk", user_id="alice")
        events = [event async for event in runner.run_async(
            user_id="alice", session_id=session.id,
            new_message=types.Content(role="user", parts=[types.Part(text="Look Jane up, please.")]),
        )]
        await runner.close()
        await http.aclose()
        return events

    events = run_in(scenario)
    said = [part.text for event in events if event.content for part in event.content.parts or [] if part.text]
    run = AgentRun.objects.get(trigger=Trigger.A2A)
    assert said and said[-1] == run.result
    # The caller's token is the owner: alice, acting for herself; the run is the ledger's.
    assert (run.agent_name, run.owner_id, run.status) == ("support", "alice", RunStatus.SUCCESS)


def test_the_0_3_method_names_on_the_same_endpoint_and_bad_input_in_json_rpcs_error_shape(server, alice):  # noqa: F811
    headers = {"Authorization": f"Token {key_of(alice)}"}

    def call(method: str, params: dict) -> httpx.Response:
        return httpx.post(f"{server}/a2a/support", headers=headers, timeout=60,
                          json={"jsonrpc": "2.0", "id": 7, "method": method, "params": params})

    sent = call("message/send", {"message": {
        "kind": "message", "messageId": str(uuid.uuid4()), "role": "user", "parts": [{"kind": "text", "text": "Hi"}],
        "metadata": {"params": {"script": [SAY_DONE]}},
    }})
    assert sent.status_code == 200, sent.text
    task = sent.json()["result"]
    assert (task["kind"], task["status"]["state"]) == ("task", "completed")
    fetched = call("tasks/get", {"id": task["id"]}).json()["result"]
    assert fetched["status"]["state"] == "completed"

    missing = call("tasks/get", {"id": str(uuid.uuid4())}).json()
    assert missing["error"]["code"] == -32001
    settled = call("tasks/cancel", {"id": task["id"]}).json()
    assert settled["error"]["code"] == -32002 and "already" in settled["error"]["message"]
    image = call("message/send", {"message": {
        "kind": "message", "messageId": str(uuid.uuid4()), "role": "user",
        "parts": [{"kind": "file", "file": {"uri": "http://example.com/a.png", "mimeType": "image/png"}}],
    }}).json()
    assert image["error"]["code"] == -32602 and "neither text" in image["error"]["message"]
    unknown = call("message/send", {"message": {
        "kind": "message", "messageId": str(uuid.uuid4()), "role": "user", "parts": [{"kind": "text", "text": "Hi"}],
        "taskId": task["id"],
    }}).json()
    assert unknown["error"]["code"] == -32602 and "waits for no input" in unknown["error"]["message"]


# --- Crashes and restarts: the task is the ledger's ---------------------------------------------------------


def _get_until(server: str, key: str, task_id: str, state, *, timeout: float = 120):  # noqa: F811
    async def get():
        http, client = await a2a_client(server, key)
        try:
            return await client.get_task(GetTaskRequest(id=task_id))
        finally:
            await http.aclose()

    return wait_until(lambda: (task := run_in(get)).status.state == state and task, timeout=timeout,
                      what=f"task {task_id} to be {TaskState.Name(state)}")


def test_a_worker_killed_mid_task_is_recovered_and_tasks_get_shows_the_outcome(server, alice):  # noqa: F811
    key = key_of(alice)

    async def start():
        http, client = await a2a_client(server, key)
        # The worker dies inside a read-only call, after the email: nothing is in doubt, so the system goes on.
        script = [SEND_EMAIL, dict(LOOKUP, crash="before_effect"), SAY_DONE]
        sent = await send(client, user_message("Email Jane.", params={"script": script}), return_immediately=True)
        await http.aclose()
        return sent[-1].task

    task = run_in(start)
    done = _get_until(server, key, task.id, TaskState.TASK_STATE_COMPLETED)
    original = AgentRun.objects.get(pk=task.id)
    assert (original.status, original.recovery) == (RunStatus.ERROR, "recovered")
    assert done.artifacts[0].parts[0].text == "Done."
    # The email was sent once: the recovery answered the call from its effect record.
    assert OutboxEmail.objects.count() == 1


def test_a_restart_while_input_required_then_the_answer_over_a2a_ends_the_same_run_once(alice, tmp_path):
    alice.user_permissions.add(Permission.objects.get(codename="approve_toolcall"))
    key = key_of(alice)

    def start_server():
        port = _free_port()
        with open(tmp_path / "web.log", "ab") as log:
            web = subprocess.Popen(web_command(host="127.0.0.1", port=port), cwd=BASE_DIR,
                                   env=child_env(LOG_LEVEL="WARNING", APPROVAL_BY_STARTER_ALLOWED="true"), stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url, web, tmp_path / "web.log")
        return web, url, start_workers(tmp_path / "workers.log")

    web, url, workers = start_server()
    try:
        async def ask():
            http, client = await a2a_client(url, key)
            sent = await send(client, user_message("Refund A-1001.", params={"script": [BIG_REFUND, REFUNDED]}))
            await http.aclose()
            return sent[-1].task

        waiting = run_in(ask)
        assert waiting.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    finally:
        stop_group(workers)
        web.kill()
        web.wait()
    web, url, workers = start_server()
    try:
        async def answer():
            http, client = await a2a_client(url, key)
            fetched = await client.get_task(GetTaskRequest(id=waiting.id))
            asked = [_compat.data_part_dict(part) for part in fetched.status.message.parts if _compat.is_data_part(part)]
            reply = Message(message_id=str(uuid.uuid4()), role=Role.ROLE_USER, task_id=waiting.id,
                            parts=[_compat.make_data_part(
                                data={"id": asked[0]["id"], "name": "adk_request_confirmation",
                                      "response": {"confirmed": True}},
                                metadata={"adk_type": "function_response"})])
            done = (await send(client, reply))[-1].task
            await http.aclose()
            return fetched, done

        fetched, done = run_in(answer)
    finally:
        stop(workers)
        stop(web)
    assert fetched.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    assert (done.id, done.status.state) == (waiting.id, TaskState.TASK_STATE_COMPLETED)
    run = AgentRun.objects.get(pk=waiting.id)
    assert (run.status, run.attempts) == (RunStatus.SUCCESS, 2)
    assert Refund.objects.count() == 1
