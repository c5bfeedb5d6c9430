"""The tool journal: every function call is written down before its tool can start.

ADK hands each event to the plugins' `on_event_callback` before it persists the event and
before the tool runs, so a row written here is committed ahead of both the session event and
the tool's effect. After a crash the journal therefore knows at least as much as the session.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from asgiref.sync import sync_to_async
from django.utils import timezone
from google.adk.plugins.base_plugin import BasePlugin

from runs.models import ToolCall, ToolCallStatus

logger = logging.getLogger(__name__)

SUMMARY_MAX_CHARS = 500
ABORTED_RESPONSE = "Invocation was aborted by client."


def summarize(value: Any) -> str:
    try:
        text = json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > SUMMARY_MAX_CHARS:
        text = f"{text[:SUMMARY_MAX_CHARS]}… ({len(text)} chars)"
    return text


def record_calls(run_id: uuid.UUID, first_seq: int, calls: list[tuple[str, str, dict]]) -> None:
    """Journal one model turn's function calls (several when the model calls in parallel)."""
    now = timezone.now()
    rows = [
        ToolCall(run_id=run_id, seq=first_seq + i, call_id=call_id, tool_name=name, args=args, called_at=now)
        for i, (call_id, name, args) in enumerate(calls)
    ]
    # A redelivered event (or a resumed invocation) must not duplicate a call already journaled.
    ToolCall.objects.bulk_create(rows, ignore_conflicts=True)


def record_outcome(run_id: uuid.UUID, call_id: str, *, status: str, summary: str) -> None:
    ToolCall.objects.filter(run_id=run_id, call_id=call_id).update(
        status=status, answered_at=timezone.now(), response_summary=summary
    )


def next_seq(run_id: uuid.UUID) -> int:
    last = ToolCall.objects.filter(run_id=run_id).order_by("-seq").values_list("seq", flat=True).first()
    return (last or 0) + 1


def journal_tools(run_id: uuid.UUID) -> list[str]:
    return list(ToolCall.objects.filter(run_id=run_id).order_by("seq").values_list("tool_name", flat=True))


class JournalPlugin(BasePlugin):
    """Writes every function call of one run to the journal, and later its outcome."""

    def __init__(self, run_id: uuid.UUID):
        super().__init__(name="agent_ledger_journal")
        self.run_id = run_id
        self._next_seq: int | None = None
        self.calls_seen = 0
        self.tool_errors: dict[str, BaseException] = {}

    async def on_event_callback(self, *, invocation_context, event):
        if event.partial:
            return None
        calls = [
            (fc.id or "", fc.name or "", dict(fc.args or {}))
            for fc in event.get_function_calls()
        ]
        if calls:
            if self._next_seq is None:
                self._next_seq = await sync_to_async(next_seq)(self.run_id)
            await sync_to_async(record_calls)(self.run_id, self._next_seq, calls)
            self._next_seq += len(calls)
            self.calls_seen += len(calls)
        for response in event.get_function_responses():
            payload = response.response or {}
            aborted = isinstance(payload, dict) and payload.get("error") == ABORTED_RESPONSE
            await sync_to_async(record_outcome)(
                self.run_id,
                response.id or "",
                status=ToolCallStatus.FAILED if aborted else ToolCallStatus.ANSWERED,
                summary="aborted before it answered" if aborted else summarize(payload),
            )
        return None

    async def on_tool_error_callback(self, *, tool, tool_args, tool_context, error):
        call_id = tool_context.function_call_id or ""
        self.tool_errors[call_id] = error
        await sync_to_async(record_outcome)(
            self.run_id,
            call_id,
            status=ToolCallStatus.FAILED,
            summary=f"{type(error).__name__}: {error}"[:SUMMARY_MAX_CHARS],
        )
        return None

