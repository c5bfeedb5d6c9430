"""Retries at the model-call boundary: the only retries that cannot repeat a side effect.

`RetryingLlm` wraps every agent's model. When one model call fails with a rate limit (HTTP 429,
`RESOURCE_EXHAUSTED`) or comes back empty, it sends the *same request* again — but only while
nothing from that call has been handed to ADK. Re-sending a request cannot run a tool (tools run
only on a response ADK has received) and cannot add the user's message to the session again
(ADK appended it once, before the first model call). Anything that has already been yielded, or
any other error, is passed on untouched, and the run settles with what it did.

Each retry is reported to the `RetryLog` of the current run, found through a context variable:
ADK runs the model inside tasks it creates itself, and tasks inherit the context of their
creator, so the log set around `Runner.run_async` reaches every model call of the run.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.utils import timezone
from google.adk.flows.llm_flows.core._finalizer import has_meaningful_content
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.genai import errors as genai_errors

logger = logging.getLogger(__name__)

RATE_LIMIT = "rate_limit"
EMPTY_TURN = "empty_turn"


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


class _Empty(Exception):
    """One model call produced nothing worth handing on."""


class RetryingLlm(BaseLlm):
    """A model that retries its inner model's rate limits and empty turns, never anything else."""

    inner: BaseLlm

    def __init__(self, *, inner: BaseLlm, **kwargs: Any):
        super().__init__(inner=inner, model=inner.model, **kwargs)

    @property
    def capabilities(self):
        return self.inner.capabilities

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        log = current_retry_log.get()
        rate_limit_retries = empty_retries = 0
        waited = 0.0
        while True:
            held: list[LlmResponse] = []
            yielded = False
            try:
                async with aclosing(self.inner.generate_content_async(llm_request, stream=stream)) as responses:
                    async for response in responses:
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
                    raise _Empty()
                return
            except _Empty:
                if empty_retries >= settings.EMPTY_TURN_RETRIES:
                    if log is not None:
                        log.gave_up = {"reason": EMPTY_TURN, "retries": empty_retries}
                    # Hand the empty turn on: ADK turns it into its "no content" error event.
                    for response in held:
                        yield response
                    return
                empty_retries += 1
                if log is not None:
                    await log.record(reason=EMPTY_TURN, attempt=empty_retries, waited_s=0.0)
                logger.info("The model returned an empty turn; asking again (%d)", empty_retries)
            except Exception as exc:
                if yielded or not is_rate_limit(exc):
                    raise
                requested = provider_retry_delay(exc)
                delay = requested
                if delay is None:
                    delay = settings.MODEL_RETRY_BASE_DELAY_SECONDS * 2**rate_limit_retries
                    delay *= 1 + random.uniform(0, 0.2)  # spread retries of concurrent runs apart
                remaining = settings.MODEL_RETRY_MAX_WAIT_SECONDS - waited
                if rate_limit_retries >= settings.MODEL_RATE_LIMIT_RETRIES or delay > remaining:
                    if log is not None:
                        log.gave_up = {
                            "reason": RATE_LIMIT,
                            "retries": rate_limit_retries,
                            "waited_s": round(waited, 3),
                            "requested_delay_s": requested,
                            "next_delay_s": round(delay, 3),
                            "over_max_wait": rate_limit_retries < settings.MODEL_RATE_LIMIT_RETRIES,
                        }
                    raise
                rate_limit_retries += 1
                logger.info("The model is rate limited; retrying in %.2f s (%d)", delay, rate_limit_retries)
                await asyncio.sleep(delay)
                waited += delay
                if log is not None:
                    await log.record(
                        reason=RATE_LIMIT,
                        attempt=rate_limit_retries,
                        waited_s=delay,
                        detail=f"429 {exc.status or 'RESOURCE_EXHAUSTED'}",
                    )
