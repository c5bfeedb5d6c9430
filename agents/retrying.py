"""The model-call boundary: what the provider may answer, and what each answer does to the run.

`RetryingLlm` wraps every agent's model. Every answer of one model call is judged against
`ANSWERS` (below, and in docs/runs.md) before anything of it reaches ADK:

- an answer the agent can use is handed on;
- an answer that another try could change (an empty turn, a stop without content, a 429, a 5xx,
  a lost connection, a body that is not JSON, no answer within MODEL_TIMEOUT_SECONDS) sends the
  *same request* again, within that answer's budget;
- anything else, or a budget spent, ends the call with an error response under a named code and
  a message a person can act on; ADK turns it into the run's final error event.

A retry cannot repeat an effect: tools run only on a response ADK has received, and ADK appended
the user's message once, before the first model call. So retrying stops as soon as anything of the
call has been handed on. A 429 that is given up is raised as it came (the run settles
`rate_limited` with the waits it made); other model failures (not the provider's, e.g. the
scripted model's `fail` step) pass untouched.

Each retry is reported to the `RetryLog` of the current run, found through a context variable:
ADK runs the model inside tasks it creates itself, and tasks inherit the context of their
creator, so the log set around `Runner.run_async` reaches every model call of the run.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import random
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import httpx
from django.conf import settings
from django.utils import timezone
from google.adk.flows.llm_flows.core._finalizer import has_meaningful_content
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.genai import errors as genai_errors
from google.genai import types

logger = logging.getLogger(__name__)

RATE_LIMIT = "rate_limit"
EMPTY_TURN = "empty_turn"
# ADK's own code for a turn without content (flows/llm_flows/core/_model_call.py): the run's
# executor says it as `empty_turn`, with the retries made.
NO_CONTENT = "MODEL_RETURNED_NO_CONTENT"

# The budgets a retry spends (each a setting, docs/configuration.md).
BAD_TURN, RATE_LIMITED, PROVIDER_FAULT, NOT_RETRIED = "bad_turn", "rate_limited", "provider_fault", "never"


@dataclass(frozen=True)
class Answer:
    """One row of the table: a kind of answer, whether it is asked again, and the run's outcome."""

    kind: str  # also the `reason` of a retry in `model_retries` and the metrics
    said: str  # what the provider answered, as docs/runs.md's table says it
    budget: str
    code: str  # the run's error_code once retrying stops
    advice: str  # what a person can do about it

    @property
    def retried(self) -> bool:
        return self.budget != NOT_RETRIED


_ROWS = [
    Answer("empty_turn", "no candidates, or a candidate without parts (or only thoughts or blank text)",
           BAD_TURN, "empty_turn", ""),
    Answer("stopped", "`finishReason` `OTHER`, `LANGUAGE`, `FINISH_REASON_UNSPECIFIED` or one newer, without content",
           BAD_TURN, "model_stopped",
           "The provider gave no reason; run it again later, and if it persists look at the request "
           "(its input, the agent's tools)."),
    Answer("malformed_function_call",
           "`finishReason` `MALFORMED_FUNCTION_CALL`, `UNEXPECTED_TOOL_CALL`, `TOO_MANY_TOOL_CALLS`",
           BAD_TURN, "malformed_function_call",
           "No tool ran. Check the agent's tool declarations (names, parameter schemas), or simplify "
           "what the run asks for."),
    Answer("recitation", "`finishReason` `RECITATION`", BAD_TURN, "recitation",
           "The answer repeated protected text too closely; rephrase the input or ask for a summary."),
    Answer("max_tokens", "`finishReason` `MAX_TOKENS` (with or without partial content)", NOT_RETRIED, "max_tokens",
           "The same request meets the same limit. Raise the agent's "
           "generate_content_config.max_output_tokens (thinking tokens count too) or ask for less."),
    Answer("answer_blocked", "`finishReason` `SAFETY`, `BLOCKLIST`, `PROHIBITED_CONTENT`, `SPII`, `IMAGE_SAFETY`, …",
           NOT_RETRIED, "answer_blocked",
           "The provider's filters decide the same way for the same request: change the input, or "
           "the agent's safety_settings where the policy allows."),
    Answer("prompt_blocked", "no candidates, `promptFeedback.blockReason` set", NOT_RETRIED, "prompt_blocked",
           "The provider refused the request itself; change the input (message, file) or the "
           "agent's instruction."),
    Answer("rate_limit", "HTTP 429 `RESOURCE_EXHAUSTED` (its `RetryInfo.retryDelay` is waited)", RATE_LIMITED,
           "rate_limited", ""),
    Answer("server_error", "HTTP 5xx (500 `INTERNAL`, 503 `UNAVAILABLE`, 504 …) or 408", PROVIDER_FAULT,
           "model_unavailable", "The provider is failing; resume or replay the run once it answers again."),
    Answer("connection_lost", "the connection refused, dropped or cut before a whole answer", PROVIDER_FAULT,
           "model_unreachable",
           "Check that the provider (GOOGLE_GEMINI_BASE_URL, a proxy) can be reached from the worker, "
           "then resume or replay the run."),
    Answer("not_json", "a body that is not Gemini's JSON (a proxy's error page, say)", PROVIDER_FAULT,
           "model_bad_response",
           "Something between the worker and the provider answers instead of it; check "
           "GOOGLE_GEMINI_BASE_URL and any proxy."),
    Answer("timeout", "no answer within `MODEL_TIMEOUT_SECONDS`", PROVIDER_FAULT, "model_timeout",
           "The provider is slow or hung; raise MODEL_TIMEOUT_SECONDS if answers this long are expected, "
           "else resume or replay the run later."),
    Answer("request_rejected", "another HTTP 4xx (400 `INVALID_ARGUMENT`, 401/403 key, 404 model)", NOT_RETRIED,
           "model_request_rejected",
           "The same request is refused the same way: check GOOGLE_API_KEY, the model's name "
           "(AGENT_MODEL or the agent's), and the input."),
]
ANSWERS: dict[str, Answer] = {row.kind: row for row in _ROWS}

_BLOCKED_FINISHES = {
    "SAFETY", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII", "IMAGE_SAFETY", "IMAGE_PROHIBITED_CONTENT",
}
_BLOCK_REASONS = {reason.value for reason in types.BlockedReason}
_FINISH_KINDS = {
    "MALFORMED_FUNCTION_CALL": "malformed_function_call",
    "UNEXPECTED_TOOL_CALL": "malformed_function_call",
    "TOO_MANY_TOOL_CALLS": "malformed_function_call",
    "RECITATION": "recitation",
    "IMAGE_RECITATION": "recitation",
    "MAX_TOKENS": "max_tokens",
    **dict.fromkeys(_BLOCKED_FINISHES, "answer_blocked"),
}


def _name(value: Any) -> str:
    return str(getattr(value, "value", value) or "")


@dataclass
class Judgement:
    answer: Answer
    detail: str  # what exactly came back, for the message and the retry log


def judge_response(response: LlmResponse) -> Judgement | None:
    """The row for an answer the agent cannot use as it is; None for one it can (or an empty one).

    An error response this table does not know (another kind of model's) is None too: it is
    handed on as it came.
    """
    finish = _name(response.finish_reason)
    if not finish:
        # No candidate but an error code: google-genai's promptFeedback.blockReason.
        if _name(response.error_code) in _BLOCK_REASONS:
            return Judgement(ANSWERS["prompt_blocked"], f"blockReason {_name(response.error_code)}")
        return None
    if finish == "STOP":
        return None
    kind = _FINISH_KINDS.get(finish)
    if kind is None and has_meaningful_content(response):
        return None  # OTHER or a reason newer than this table, on an answer that can be used
    detail = f"finishReason {finish}"
    if response.error_message:
        detail += f": {response.error_message}"
    return Judgement(ANSWERS[kind or "stopped"], detail)


def judge_exception(exc: BaseException) -> Judgement | None:
    """The row for a failed model call, or None for a failure that is not the provider's."""
    if is_rate_limit(exc):
        return Judgement(ANSWERS["rate_limit"], f"429 {exc.status or 'RESOURCE_EXHAUSTED'}")
    if isinstance(exc, genai_errors.APIError):
        said = f"{exc.code} {exc.status or ''}".strip()
        if exc.message:
            said += f": {exc.message}"
        kind = "server_error" if isinstance(exc, genai_errors.ServerError) or exc.code == 408 else "request_rejected"
        return Judgement(ANSWERS[kind], said[:300])
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return Judgement(ANSWERS["timeout"], f"no answer within {settings.MODEL_TIMEOUT_SECONDS:g} s")
    if isinstance(exc, httpx.TransportError):
        return Judgement(ANSWERS["connection_lost"], f"{type(exc).__name__}: {exc}"[:300])
    if isinstance(exc, json.JSONDecodeError):
        return Judgement(ANSWERS["not_json"], f"{exc.msg} at character {exc.pos}: {exc.doc[:60]!r}")
    return None


def is_rate_limit(exc: BaseException) -> bool:
    return isinstance(exc, genai_errors.ClientError) and (
        exc.code == 429 or exc.status == "RESOURCE_EXHAUSTED"
    )


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*s\s*$")


def provider_retry_delay(exc: BaseException) -> float | None:
    """The wait the provider asked for (google.rpc.RetryInfo.retryDelay), in seconds, if any."""
    details = getattr(exc, "details", None)
    if isinstance(details, dict):
        details = (details.get("error") or details).get("details")
    if not isinstance(details, list):
        return None
    for detail in details:
        if not isinstance(detail, dict) or not str(detail.get("@type", "")).endswith("RetryInfo"):
            continue
        delay = detail.get("retryDelay")
        if isinstance(delay, str) and (match := _DURATION.match(delay)):
            return float(match.group(1))
        if isinstance(delay, dict):  # the proto's JSON form when not rendered as a string
            return float(delay.get("seconds", 0)) + float(delay.get("nanos", 0)) / 1e9
    return None


@dataclass
class RetryLog:
    """The model-call retries of one run, and why retrying stopped if it did.

    `on_change` receives the whole list after every retry so the run's record is current while
    the run is still going (the admin shows it live; a crash does not lose it).
    """

    on_change: Callable[[list[dict]], Awaitable[None]] | None = None
    entries: list[dict] = field(default_factory=list)
    # The last model call that was not retried any further: its reason, retries and why it stopped.
    gave_up: dict | None = None

    def count(self, reason: str | None = None) -> int:
        return sum(1 for entry in self.entries if reason is None or entry["reason"] == reason)

    async def record(self, *, reason: str, attempt: int, waited_s: float, detail: str = "") -> None:
        entry = {
            "reason": reason,
            "attempt": attempt,
            "waited_s": round(waited_s, 3),
            "at": timezone.now().isoformat(),
        }
        if detail:
            entry["detail"] = detail
        self.entries.append(entry)
        if self.on_change is not None:
            try:
                await self.on_change(list(self.entries))
            except Exception:  # noqa: BLE001 - bookkeeping must never fail the model call
                logger.exception("Could not record a model retry")


current_retry_log: contextvars.ContextVar[RetryLog | None] = contextvars.ContextVar(
    "current_retry_log", default=None
)


def _budget(budget: str) -> int:
    return {
        BAD_TURN: settings.EMPTY_TURN_RETRIES,
        RATE_LIMITED: settings.MODEL_RATE_LIMIT_RETRIES,
        PROVIDER_FAULT: settings.MODEL_FAULT_RETRIES,
    }.get(budget, 0)


_BUDGET_SETTING = {
    BAD_TURN: "EMPTY_TURN_RETRIES",
    RATE_LIMITED: "MODEL_RATE_LIMIT_RETRIES",
    PROVIDER_FAULT: "MODEL_FAULT_RETRIES",
}


def _times(count: int) -> str:
    return "once" if count == 1 else f"{count} times"


def failure_message(judgement: Judgement, *, attempts: int, mid_answer: bool = False) -> str:
    """What the run's error says: what came back, how often it was asked, what to do."""
    answer = judgement.answer
    provider = "The model provider"
    if answer.budget == PROVIDER_FAULT:
        said = f"{provider} failed the model call ({judgement.detail})"
    elif answer.kind == "request_rejected":
        said = f"{provider} rejected the model call ({judgement.detail})"
    elif answer.kind == "prompt_blocked":
        said = f"{provider} blocked the request ({judgement.detail})"
    else:
        said = f"The model ended its answer without a usable result ({judgement.detail})"
    if mid_answer:
        said += " in the middle of an answer, which cannot be retried safely"
    elif answer.retried:
        said += (
            f" on all {attempts} attempts (asked again {_times(attempts - 1)}, "
            f"{_BUDGET_SETTING[answer.budget]}={_budget(answer.budget)})"
            if attempts > 1 else f"; it was not asked again ({_BUDGET_SETTING[answer.budget]}=0)"
        )
    else:
        said += "; asking again would get the same answer"
    return f"{said}. {answer.advice}".strip()


def error_response(judgement: Judgement, message: str) -> LlmResponse:
    code = NO_CONTENT if judgement.answer.kind == EMPTY_TURN else judgement.answer.code.upper()
    return LlmResponse(error_code=code, error_message=message)


class _Retry(Exception):
    def __init__(self, judgement: Judgement, held: list[LlmResponse], cause: BaseException | None = None):
        super().__init__(judgement.answer.kind)
        self.judgement, self.held, self.cause = judgement, held, cause


class RetryingLlm(BaseLlm):
    """A model whose every answer is judged against `ANSWERS` before the agent sees it."""

    inner: BaseLlm

    def __init__(self, *, inner: BaseLlm, **kwargs: Any):
        super().__init__(inner=inner, model=inner.model, **kwargs)

    @property
    def capabilities(self):
        return self.inner.capabilities

    async def _responses(self, llm_request: LlmRequest, stream: bool) -> AsyncGenerator[LlmResponse, None]:
        """The inner model's responses, each within MODEL_TIMEOUT_SECONDS of the previous one."""
        timeout = settings.MODEL_TIMEOUT_SECONDS
        async with aclosing(self.inner.generate_content_async(llm_request, stream=stream)) as responses:
            iterator = aiter(responses)
            while True:
                # Only the time spent inside the model counts: not the agent's, between answers.
                async with asyncio.timeout(timeout):
                    try:
                        response = await anext(iterator)
                    except StopAsyncIteration:
                        return
                yield response

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        log = current_retry_log.get()
        retries: dict[str, int] = {}
        waited = 0.0
        while True:
            held: list[LlmResponse] = []
            yielded = False
            try:
                async with aclosing(self._responses(llm_request, stream)) as responses:
                    async for response in responses:
                        judgement = judge_response(response)
                        if judgement is not None:
                            if yielded:
                                yield error_response(
                                    judgement, failure_message(judgement, attempts=1, mid_answer=True)
                                )
                                return
                            raise _Retry(judgement, held)
                        if not yielded and response.error_code is None and not has_meaningful_content(response):
                            # Nothing to act on yet: hold it back, so an empty turn can still be retried.
                            held.append(response)
                            continue
                        for earlier in held:
                            yield earlier
                        held.clear()
                        yielded = True
                        yield response
                if not yielded:
                    raise _Retry(Judgement(ANSWERS[EMPTY_TURN], "no content"), held)
                return
            except _Retry as retry:
                judgement, cause = retry.judgement, retry.cause
            except Exception as exc:
                judgement = judge_exception(exc)
                if judgement is None:
                    raise
                if yielded:
                    if is_rate_limit(exc):
                        raise
                    yield error_response(judgement, failure_message(judgement, attempts=1, mid_answer=True))
                    return
                cause = exc

            answer = judgement.answer
            made = retries.get(answer.budget, 0)
            delay = 0.0
            requested = None
            if answer.budget in (RATE_LIMITED, PROVIDER_FAULT):
                requested = provider_retry_delay(cause) if cause is not None else None
                delay = requested if requested is not None else self._backoff(made)
            over_max_wait = delay > settings.MODEL_RETRY_MAX_WAIT_SECONDS - waited
            if not answer.retried or made >= _budget(answer.budget) or over_max_wait:
                if log is not None:
                    log.gave_up = {"reason": answer.kind, "retries": made, "waited_s": round(waited, 3)}
                    if answer.budget == RATE_LIMITED:
                        log.gave_up.update(
                            requested_delay_s=requested,
                            next_delay_s=round(delay, 3),
                            over_max_wait=made < _budget(answer.budget),
                        )
                if answer.kind == RATE_LIMIT and cause is not None:
                    raise cause
                message = failure_message(judgement, attempts=made + 1)
                if over_max_wait and answer.retried and made < _budget(answer.budget):
                    message += (
                        f" (The next wait of {delay:g} s would have passed MODEL_RETRY_MAX_WAIT_SECONDS="
                        f"{settings.MODEL_RETRY_MAX_WAIT_SECONDS:g}.)"
                    )
                logger.info("Model call given up: %s (%s)", answer.kind, judgement.detail)
                yield error_response(judgement, message)
                return
            retries[answer.budget] = made + 1
            logger.info("Model call answered %s; asking again in %.2f s (%d)", answer.kind, delay, made + 1)
            if delay:
                await asyncio.sleep(delay)
                waited += delay
            if log is not None:
                await log.record(reason=answer.kind, attempt=made + 1, waited_s=delay, detail=judgement.detail[:200])

    @staticmethod
    def _backoff(retries_made: int) -> float:
        delay = settings.MODEL_RETRY_BASE_DELAY_SECONDS * 2**retries_made
        return delay * (1 + random.uniform(0, 0.2))  # spread retries of concurrent runs apart
