"""Retries at the model-call boundary, and no retry of a turn once a call has passed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from django.core import mail
from django.urls import reverse
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.genai import errors as genai_errors
from google.genai import types

from agents import scripted
from agents.models import AdkEvent, OutboxEmail
from agents.registry import build_agent, get_agent_spec
from agents.retrying import RetryingLlm, RetryLog, current_retry_log, provider_retry_delay
from runs.models.ledger import AgentRun, RunStatus, ToolCallStatus
from tests.helpers import LOOKUP, SAY_DONE, SEND_EMAIL, run_now, script_params

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
runs_for_real = pytest.mark.django_db(transaction=True)

RATE_LIMIT = {"fail": "rate_limit"}
EMPTY = {"empty": True}

MESSAGE = "Jane asks about her refund."


@pytest.fixture(autouse=True)
def _fast_backoff(settings):
    settings.MODEL_RETRY_BASE_DELAY_SECONDS = 0.01
    settings.MODEL_RATE_LIMIT_RETRIES = 2
    settings.MODEL_RETRY_MAX_WAIT_SECONDS = 5
    settings.EMPTY_TURN_RETRIES = 1


@pytest.fixture
def model_requests():
    """Every request the scripted model received, as (number of contents, last user text)."""
    seen: list[LlmRequest] = []
    scripted.request_observers.append(seen.append)
    yield seen
    scripted.request_observers.remove(seen.append)


def _user_messages(run: AgentRun) -> list[str]:
    events = AdkEvent.objects.filter(session_id=run.session_id).order_by("timestamp")
    return [part.get("text", "") for e in events if e.author == "user" for part in e.parts]


# --- The scenario: a tool ran, then the next model call was rate limited ----------------------------


@runs_for_real
def test_rate_limit_after_send_email_is_retried_at_the_call_and_sends_one_email(model_requests):
    run = run_now(message=MESSAGE, params=script_params(SEND_EMAIL, RATE_LIMIT, SAY_DONE))

    assert run.status == RunStatus.SUCCESS, run.error_message
    assert run.result == "Done."
    assert run.tools_executed == ["send_email"]
    assert OutboxEmail.objects.filter(run_id=run.run_id).count() == 1
    assert len(mail.outbox) == 1
    assert _user_messages(run) == [MESSAGE]
    assert [c.tool_name for c in run.tool_calls.all()] == ["send_email"]

    assert len(run.model_retries) == 1
    retry = run.model_retries[0]
    assert retry["reason"] == "rate_limit" and retry["attempt"] == 1
    assert retry["waited_s"] > 0 and retry["at"]

    # The retried request is the very request that was rate limited: same history, the tool's
    # answer included, the user's message once.
    assert len(model_requests) == 3
    assert model_requests[1].contents == model_requests[2].contents
    user_texts = [
        part.text for content in model_requests[2].contents if content.role == "user" for part in content.parts if part.text
    ]
    assert user_texts == [MESSAGE]


@runs_for_real
def test_rate_limit_before_any_call_is_retried_and_succeeds():
    run = run_now(params=script_params(RATE_LIMIT, SEND_EMAIL, SAY_DONE))

    assert run.status == RunStatus.SUCCESS, run.error_message
    assert run.tools_executed == ["send_email"]
    assert OutboxEmail.objects.filter(run_id=run.run_id).count() == 1
    assert [r["reason"] for r in run.model_retries] == ["rate_limit"]


@runs_for_real
def test_two_rate_limits_in_a_row_use_the_whole_budget_with_growing_waits():
    run = run_now(params=script_params(RATE_LIMIT, RATE_LIMIT, SAY_DONE))

    assert run.status == RunStatus.SUCCESS, run.error_message
    assert [(r["reason"], r["attempt"]) for r in run.model_retries] == [("rate_limit", 1), ("rate_limit", 2)]
    first, second = (r["waited_s"] for r in run.model_retries)
    assert second > first  # exponential: base, then twice the base (each with under 20% jitter)


@runs_for_real
def test_rate_limits_beyond_the_budget_settle_as_error_with_the_tools_and_no_turn_retry(model_requests):
    run = run_now(params=script_params(LOOKUP, SEND_EMAIL, RATE_LIMIT, RATE_LIMIT, RATE_LIMIT, SAY_DONE))

    assert run.status == RunStatus.ERROR
    assert run.error_code == "rate_limited"
    assert "rate-limited" in run.error_message
    assert "retried 2 times" in run.error_message
    assert "MODEL_RATE_LIMIT_RETRIES=2" in run.error_message
    assert run.tools_executed == ["lookup_customer", "send_email"]
    assert len(run.model_retries) == 2

    # Nothing restarted the turn: two calls that succeeded, then one call tried three times.
    assert len(model_requests) == 2 + 3
    assert OutboxEmail.objects.filter(run_id=run.run_id).count() == 1
    assert _user_messages(run) == [MESSAGE]
    assert all(c.status == ToolCallStatus.ANSWERED for c in run.tool_calls.all())


@runs_for_real
def test_rate_limit_with_no_retries_allowed_fails_at_once_and_says_so(settings):
    settings.MODEL_RATE_LIMIT_RETRIES = 0
    run = run_now(params=script_params(RATE_LIMIT, SAY_DONE))

    assert run.status == RunStatus.ERROR
    assert run.error_code == "rate_limited"
    assert "retried 0 times" in run.error_message
    assert run.tools_executed == []
    assert run.model_retries == []


@runs_for_real
def test_the_providers_retry_delay_is_honoured():
    run = run_now(params=script_params({"fail": "rate_limit", "retry_delay": 0.3}, SAY_DONE))

    assert run.status == RunStatus.SUCCESS, run.error_message
    assert run.model_retries[0]["waited_s"] == 0.3


@runs_for_real
def test_a_requested_wait_beyond_the_maximum_gives_up_without_waiting(settings):
    settings.MODEL_RETRY_MAX_WAIT_SECONDS = 2
    run = run_now(params=script_params(SEND_EMAIL, {"fail": "rate_limit", "retry_delay": 120}, SAY_DONE))

    assert run.status == RunStatus.ERROR
    assert run.error_code == "rate_limited"
    assert "120 s" in run.error_message and "MODEL_RETRY_MAX_WAIT_SECONDS=2" in run.error_message
    assert run.model_retries == []
    assert run.tools_executed == ["send_email"]


# --- Empty turns ------------------------------------------------------------------------------------


@runs_for_real
def test_an_empty_turn_is_retried_once_then_succeeds():
    run = run_now(params=script_params(EMPTY, SEND_EMAIL, SAY_DONE))

    assert run.status == RunStatus.SUCCESS, run.error_message
    assert run.result == "Done."
    assert run.tools_executed == ["send_email"]
    assert [(r["reason"], r["attempt"]) for r in run.model_retries] == [("empty_turn", 1)]
    # The empty answer never reached the session.
    events = AdkEvent.objects.filter(session_id=run.session_id)
    assert not [e for e in events if e.data.get("error_code")]


@runs_for_real
def test_an_empty_turn_after_a_call_is_retried_without_repeating_the_call():
    run = run_now(params=script_params(SEND_EMAIL, EMPTY, SAY_DONE))

    assert run.status == RunStatus.SUCCESS, run.error_message
    assert OutboxEmail.objects.filter(run_id=run.run_id).count() == 1


@runs_for_real
def test_two_empty_turns_end_in_an_error_a_person_understands():
    run = run_now(params=script_params(SEND_EMAIL, EMPTY, EMPTY, SAY_DONE))

    assert run.status == RunStatus.ERROR
    assert run.error_code == "empty_turn"
    assert run.error_message == (
        "The model returned an empty answer 2 times in a row (it was asked again 1 time, "
        "EMPTY_TURN_RETRIES=1), so the run stopped without a result."
    )
    assert run.tools_executed == ["send_email"]
    assert len(run.model_retries) == 1


# --- The rule inside one model call: retry only while nothing was yielded ----------------------------


class _StreamThenFail(BaseLlm):
    """Streams a partial answer, then fails with a rate limit: the answer is already out."""

    model: str = "stream-then-fail"
    calls: int = 0

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        self.calls += 1
        yield LlmResponse(content=types.Content(role="model", parts=[types.Part(text="Sending")]), partial=True)
        raise scripted.rate_limit_error()


class _Flaky(BaseLlm):
    """Fails with the given errors in order, then answers."""

    model: str = "flaky"
    errors: list = []
    calls: int = 0

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        yield LlmResponse(content=types.Content(role="model", parts=[types.Part(text="ok")]))


async def _collect(model: BaseLlm, log: RetryLog | None = None) -> list[LlmResponse]:
    token = current_retry_log.set(log)
    try:
        return [r async for r in model.generate_content_async(LlmRequest(), stream=True)]
    finally:
        current_retry_log.reset(token)


def test_a_rate_limit_after_something_was_yielded_is_never_retried(settings):
    settings.MODEL_RETRY_BASE_DELAY_SECONDS = 0.01
    inner = _StreamThenFail()
    with pytest.raises(genai_errors.ClientError):
        asyncio.run(_collect(RetryingLlm(inner=inner)))
    assert inner.calls == 1


def test_a_rejected_request_is_not_retried_and_is_named_as_the_providers(settings):
    inner = _Flaky(errors=[genai_errors.ClientError(400, {"error": {"code": 400, "status": "INVALID_ARGUMENT"}})])
    [response] = asyncio.run(_collect(RetryingLlm(inner=inner)))
    assert inner.calls == 1
    assert response.error_code == "MODEL_REQUEST_REJECTED"
    assert response.error_message.startswith("The model provider rejected the model call (400 INVALID_ARGUMENT)")


def test_failures_that_are_not_the_providers_pass_untouched(settings):
    inner = _Flaky(errors=[scripted.ScriptedModelError("The scripted model failed.")])
    with pytest.raises(scripted.ScriptedModelError):
        asyncio.run(_collect(RetryingLlm(inner=inner)))
    assert inner.calls == 1


def test_the_wrapper_records_to_the_log_of_the_current_context(settings):
    settings.MODEL_RETRY_BASE_DELAY_SECONDS = 0.01
    log = RetryLog()
    inner = _Flaky(errors=[scripted.rate_limit_error(0.02)])
    responses = asyncio.run(_collect(RetryingLlm(inner=inner), log))
    assert [r.content.parts[0].text for r in responses] == ["ok"]
    assert inner.calls == 2
    assert [(e["reason"], e["waited_s"]) for e in log.entries] == [("rate_limit", 0.02)]


@pytest.mark.parametrize(
    "delay, expected",
    [("0.5s", 0.5), ("12s", 12.0), ({"seconds": 3, "nanos": 500_000_000}, 3.5), ("soon", None)],
)
def test_the_providers_retry_delay_is_read_from_the_error(delay, expected):
    error = genai_errors.ClientError(
        429,
        {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "details": [
            {"@type": "type.googleapis.com/google.rpc.QuotaFailure"},
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay},
        ]}},
    )
    assert provider_retry_delay(error) == expected
    assert provider_retry_delay(scripted.rate_limit_error()) is None


# --- No turn-level retry ------------------------------------------------------------------------------


def test_every_agent_gets_the_retrying_model_and_no_turn_level_retry():
    agent = build_agent(get_agent_spec("support"), params={})
    assert isinstance(agent.model, RetryingLlm)
    assert isinstance(agent.model.inner, scripted.ScriptedLlm)
    # A node retry re-runs the whole agent turn from its history: never on an agent with tools.
    assert agent.retry_config is None


def test_a_gemini_model_is_wrapped_too(settings):
    from google.adk.models.google_llm import Gemini

    settings.AGENT_MODEL = "gemini-2.5-flash"
    agent = build_agent(get_agent_spec("support"), params={"script": [SAY_DONE]})
    assert isinstance(agent.model, RetryingLlm)
    assert isinstance(agent.model.inner, Gemini)
    assert agent.model.model == "gemini-2.5-flash"


# --- Visible in the admin -------------------------------------------------------------------------


@runs_for_real
def test_retries_are_shown_on_the_admin_run_page(admin_client):
    run = run_now(params=script_params(RATE_LIMIT, EMPTY, SAY_DONE))
    assert run.status == RunStatus.SUCCESS, run.error_message

    page = admin_client.get(reverse("admin:runs_agentrun_change", args=[run.run_id]))
    assert page.status_code == 200
    text = page.content.decode()
    assert "2 retries" in text
    assert "rate limit (attempt 1" in text
    assert "empty turn (attempt 1" in text
