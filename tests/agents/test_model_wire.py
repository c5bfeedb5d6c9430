"""The real model's wire: the google-genai client over HTTP against a server speaking Gemini's REST API.

Every test here runs the bundled `support` agent with `GOOGLE_API_KEY` set and
`GOOGLE_GEMINI_BASE_URL` pointing at `tests/fake_gemini.py` on a free port, so each model call is a
real HTTP request and each answer a real Gemini JSON body (or a real fault: a dropped connection,
a proxy's HTML page, a hang).
"""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from agents.models import CrmNote, OutboxEmail
from agents.retrying import ANSWERS
from runs.execution.executor import execute as execute_run
from runs.ledger import reconcile
from runs.models.ledger import AgentRun, RunStatus
from runs.services import run as services
from tests import fake_gemini as fg
from tests.helpers import BASE_DIR, child_env, postgres_only, run_now
from tests.kit import api

# Runs cross from Django's connection to ADK's own engine, which must see committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

EMAIL = {"to": "jane@example.com", "subject": "Your refund", "body": "Your refund has been issued."}
CRM = {"contact_id": "C-1001", "note": "Refund confirmed by email."}
DONE = fg.text("Done.")


@pytest.fixture
def gemini(settings, monkeypatch):
    """The fake Gemini, and every model call of the app sent to it."""
    with fg.FakeGemini() as fake:
        for name, value in fake.env().items():
            monkeypatch.setenv(name, value)
        settings.GOOGLE_API_KEY = "fake-key"
        settings.AGENT_MODEL = "gemini-2.5-flash"
        settings.MODEL_RETRY_BASE_DELAY_SECONDS = 0.01
        settings.EMPTY_TURN_RETRIES = 1
        settings.MODEL_RATE_LIMIT_RETRIES = 1
        settings.MODEL_FAULT_RETRIES = 1
        # Above what a first call takes on a busy machine (the client is built inside it).
        settings.MODEL_TIMEOUT_SECONDS = 3
        yield fake


def _detail(run: AgentRun, user) -> dict:
    client = api(user)
    response = client.get(f"/api/runs/{run.run_id}/")
    assert response.status_code == 200, response.content[:300]
    return response.json()


# --- The table, row by row -------------------------------------------------------------------------

# (row of agents.retrying.ANSWERS, what the fake server answers)
ROWS = [
    ("empty_turn", fg.no_candidates()),
    ("empty_turn", fg.finish("STOP", parts=[])),
    ("empty_turn", fg.finish(None, parts=[])),
    ("empty_turn", fg.finish("STOP", parts=[{"text": "hidden reasoning", "thought": True}])),
    ("stopped", fg.finish("OTHER")),
    ("stopped", fg.finish("FINISH_REASON_UNSPECIFIED")),
    ("malformed_function_call", fg.finish("MALFORMED_FUNCTION_CALL", message="Malformed function call: send_emal(")),
    ("recitation", fg.finish("RECITATION")),
    ("max_tokens", fg.finish("MAX_TOKENS", parts=[{"text": "Dear Jane, your refund of"}])),
    ("max_tokens", fg.finish("MAX_TOKENS")),
    ("answer_blocked", fg.finish("SAFETY")),
    ("answer_blocked", fg.finish("BLOCKLIST")),
    ("answer_blocked", fg.finish("PROHIBITED_CONTENT")),
    ("answer_blocked", fg.finish("SPII")),
    ("prompt_blocked", fg.prompt_blocked("SAFETY")),
    ("rate_limit", fg.rate_limited("0s")),
    ("server_error", fg.unavailable()),
    ("server_error", fg.error(500, "INTERNAL", "An internal error has occurred.")),
    ("connection_lost", {"fault": "drop"}),
    ("connection_lost", {"fault": "cut"}),
    ("not_json", {"fault": "not_json"}),
    ("timeout", {"fault": "slow", "seconds": 60, "then": fg.text("Too late.")}),
    ("request_rejected", fg.error(400, "INVALID_ARGUMENT", "Request contains an invalid argument.")),
    ("request_rejected", fg.error(403, "PERMISSION_DENIED", "API key not valid.")),
]
ROW_IDS = [f"{kind}-{index}" for index, (kind, _reply) in enumerate(ROWS)]


def test_every_row_of_the_table_is_driven_here():
    assert {kind for kind, _reply in ROWS} == set(ANSWERS)


@pytest.mark.parametrize("kind, reply", ROWS, ids=ROW_IDS)
def test_each_answer_on_the_first_call_is_asked_again_or_named(gemini, kind, reply, admin_user):
    answer = ANSWERS[kind]
    gemini.add(reply, DONE)

    run = run_now(message="Jane asks about her refund.")

    if answer.retried:
        assert (run.status, run.result) == (RunStatus.SUCCESS, "Done."), run.error_message
        assert len(gemini.requests) == 2
        # The same request again: a retry re-sends, it does not rebuild the conversation.
        assert gemini.requests[1].body == gemini.requests[0].body
        retries = _detail(run, admin_user)["model_retries"]
        assert [(r["reason"], r["attempt"]) for r in retries] == [(kind, 1)]
    else:
        assert (run.status, run.error_code) == (RunStatus.ERROR, answer.code)
        assert len(gemini.requests) == 1
        assert answer.advice in run.error_message
        assert run.model_retries == []
    assert run.tools_executed in ([], None)


@pytest.mark.parametrize("kind, reply", ROWS, ids=ROW_IDS)
def test_each_answer_after_send_email_never_settles_success_and_never_repeats_the_email(gemini, kind, reply, admin_user):
    answer = ANSWERS[kind]
    # As often as the budget allows and once more: the provider keeps answering the same way.
    gemini.add(fg.call("send_email", EMAIL), *[reply] * 2, fg.call("update_crm", CRM), DONE)

    run = run_now(message="Jane asks about her refund.")

    assert run.status == RunStatus.ERROR
    assert run.error_code == answer.code
    assert run.tools_executed == ["send_email"]
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 0
    assert len(gemini.requests) == (3 if answer.retried else 2)
    retries = _detail(run, admin_user)["model_retries"]
    assert [r["reason"] for r in retries] == ([kind] if answer.retried else [])
    # Said as what it is, with what came back — never a bare finish reason or an exception's repr.
    assert len(run.error_message) > 60 and not run.error_message.startswith(("OTHER", "Remote", "JSON"))
    if answer.budget == "provider_fault":
        assert run.error_message.startswith("The model provider failed the model call")
    if answer.retried and kind != "rate_limit":
        assert "2 attempts" in run.error_message or "2 times in a row" in run.error_message


def test_a_retry_after_a_provider_fault_waits_and_is_recorded_with_what_came_back(gemini, admin_user, settings):
    settings.MODEL_FAULT_RETRIES = 2
    gemini.add(fg.unavailable(), {"fault": "drop"}, DONE)

    run = run_now()

    assert run.status == RunStatus.SUCCESS, run.error_message
    retries = _detail(run, admin_user)["model_retries"]
    assert [(r["reason"], r["attempt"]) for r in retries] == [("server_error", 1), ("connection_lost", 2)]
    assert retries[0]["detail"].startswith("503 UNAVAILABLE") and retries[1]["waited_s"] > 0


def test_a_rate_limit_waits_the_providers_retry_delay(gemini):
    gemini.add(fg.rate_limited("0.3s"), DONE)
    started = time.monotonic()
    run = run_now()
    assert run.status == RunStatus.SUCCESS
    assert time.monotonic() - started >= 0.3
    assert run.model_retries[0]["waited_s"] == 0.3


# --- What the app sends -----------------------------------------------------------------------------


def test_the_support_agents_requests_carry_its_instruction_tools_and_signatures(gemini):
    gemini.responder = fg.support_conversation

    run = run_now(message="Jane asks about her refund.")

    assert (run.status, run.result) == (RunStatus.SUCCESS, fg.SUPPORT_ANSWER), run.error_message
    assert run.tools_executed == ["lookup_customer", "send_email", "update_crm"]
    assert len(gemini.requests) == 4
    for number, request in enumerate(gemini.requests):
        assert request.path == "/v1beta/models/gemini-2.5-flash:generateContent"
        assert request.headers["x-goog-api-key"] == "fake-key"
        assert "You are a customer support agent" in request.system_instruction
        # preload_memory is never declared to the model: it only adds context.
        assert sorted(request.function_names) == [
                "issue_refund", "lookup_customer", "request_return_label", "send_email", "update_crm",
            ]
        assert request.contents[0] == {"role": "user", "parts": [{"text": "Jane asks about her refund."}]}
        # Each earlier call goes back with the thought signature Gemini gave it, byte for byte.
        sent_back = [p for c in request.contents for p in c["parts"] if "functionCall" in p]
        assert [(p["functionCall"]["name"], p.get("thoughtSignature")) for p in sent_back] == [
            (name, fg.signature(name)) for name, _args in fg.SUPPORT_STEPS[:number]
        ]
        assert [r["name"] for r in request.function_responses()] == [n for n, _a in fg.SUPPORT_STEPS[:number]]


def test_the_providers_call_ids_round_trip_to_the_journal_and_back(gemini):
    gemini.add(
        fg.call("send_email", EMAIL, call_id="call-7f3a", thought_signature=fg.signature("e")),
        DONE,
    )

    run = run_now()

    assert run.status == RunStatus.SUCCESS, run.error_message
    assert list(run.tool_calls.values_list("call_id", "tool_name")) == [("call-7f3a", "send_email")]
    second = gemini.requests[1]
    [model_call] = [p for c in second.contents for p in c["parts"] if "functionCall" in p]
    assert model_call["functionCall"]["id"] == "call-7f3a"
    assert model_call["thoughtSignature"] == fg.signature("e")
    [response] = second.function_responses()
    assert (response["id"], response["name"], response["response"]["status"]) == ("call-7f3a", "send_email", "sent")


def test_parallel_calls_in_one_answer_run_once_each_and_answer_together(gemini):
    gemini.add(
        fg.calls(
            fg.call_part("send_email", EMAIL, thought_signature=fg.signature("parallel")),
            fg.call_part("update_crm", CRM),
        ),
        DONE,
    )

    run = run_now()

    assert run.status == RunStatus.SUCCESS, run.error_message
    assert sorted(run.tools_executed) == ["send_email", "update_crm"]
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 1
    second = gemini.requests[1]
    answers = [c for c in second.contents if any("functionResponse" in p for p in c["parts"])]
    assert len(answers) == 1 and sorted(p["functionResponse"]["name"] for p in answers[0]["parts"]) == [
        "send_email", "update_crm"]
    # Only the first of parallel calls carries the signature, and it goes back on that one.
    [model_turn] = [c for c in second.contents if c["role"] == "model"]
    assert [p.get("thoughtSignature") for p in model_turn["parts"]] == [fg.signature("parallel"), None]


def test_the_runs_file_reaches_every_model_call_beside_the_owners_memories(gemini):
    gemini.responder = fg.support_conversation
    first = run_now(message="Jane asks about her refund.")
    assert first.status == RunStatus.SUCCESS, first.error_message
    gemini.requests.clear()
    photo = b"\x89PNG\r\n\x1a\n" + os.urandom(300)

    second = run_now(message="Jane asks about her refund again.", file=io.BytesIO(photo), file_name="receipt.png")

    assert second.status == RunStatus.SUCCESS, second.error_message
    assert len(gemini.requests) == 4
    for request in gemini.requests:
        # ADK puts the owner's memories after the latest tool answer; the run's file stays whole.
        assert any("<PAST_CONVERSATIONS>" in text and "Jane asks about her refund." in text for text in request.texts())
        # google-genai sends the bytes URL-safe base64-encoded.
        assert [(d.get("mimeType") or d.get("mime_type"), base64.urlsafe_b64decode(d["data"])) for d in request.inline_data()] == [
            ("image/png", photo)
        ]
        assert not any(text.startswith("<stripped:") for text in request.texts())


def test_a_conversations_earlier_file_is_stripped_and_its_latest_kept(gemini):
    gemini.add(DONE, DONE)
    earlier, latest = os.urandom(300), os.urandom(300)
    first = run_now(message="Here is the first scan.", file=io.BytesIO(earlier), file_name="one.pdf")
    second = run_now(message="And the second.", file=io.BytesIO(latest), file_name="two.pdf",
                     session_id=first.session_id)

    assert second.status == RunStatus.SUCCESS, second.error_message
    last = gemini.requests[-1]
    assert [base64.urlsafe_b64decode(d["data"]) for d in last.inline_data()] == [latest]
    assert f"<stripped: {len(base64.b64encode(earlier))} chars>" in last.texts()


# --- A crash during a model call, then resume ----------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import django
    django.setup()
    from runs.execution import executor
    executor.execute({run_id!r})
    """
)


@postgres_only
def test_a_worker_killed_during_a_model_call_resumes_without_repeating_the_email(gemini, admin_user, settings):

    # The second model call hangs at the provider: the worker is killed while waiting for it.
    gemini.add(fg.call("send_email", EMAIL, thought_signature=fg.signature("email")), {"fault": "hang"})
    run = services.start_run(enqueue=False, agent_name="support", owner_id="alice", message="Jane asks about her refund.")
    env = child_env(**gemini.env(), AGENT_MODEL="gemini-2.5-flash", MODEL_TIMEOUT_SECONDS="60")
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(run_id=str(run.run_id))], cwd=BASE_DIR, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(gemini.requests) < 2:
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the child never made its second model call"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()
    assert OutboxEmail.objects.count() == 1

    from tests.processes.test_crash_matrix import _past_the_stale_window

    reconcile.sweep(now=_past_the_stale_window())
    run.refresh_from_db()
    assert (run.status, run.error_code, run.tools_executed) == (RunStatus.ERROR, "reconciled", ["send_email"])

    gemini.requests.clear()
    gemini.add(fg.call("update_crm", CRM), fg.text("Emailed Jane and noted it."))
    again = services.resume_run(run.run_id, actor=admin_user)
    execute_run(str(again.run_id))
    again.refresh_from_db()

    assert again.status == RunStatus.SUCCESS, again.error_message
    assert again.tools_executed == ["update_crm"]
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 1
    # The resumed run's first request: the original call with its signature, answered from the record.
    first = gemini.requests[0]
    [sent_back] = [p for c in first.contents for p in c["parts"] if "functionCall" in p]
    assert sent_back["thoughtSignature"] == fg.signature("email")
    assert [(r["name"], r["response"]["status"]) for r in first.function_responses()] == [("send_email", "sent")]
