"""A run's events as ADK's API server sends them: executed here like a chat turn, or followed from the ledger.

A new message is executed on the server's loop (`runs.chat.turns.ChatTurn`, the chat's own
machinery): its events stream as ADK yields them, and a client that leaves aborts the invocation
so the run settles `cancelled` with its tools listed. A run that goes on after its waiting calls
were answered is continued by a worker, like every answered run (`runs.ledger.approvals`): its events
are read from the session as they are stored, until the run settles or waits again; a client
that leaves cancels it through `runs.services.run.cancel_run`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import sync_to_async
from google.adk.auth.auth_credential import _redact_credential_secrets
from google.adk.events._internal_metadata import public_event
from google.adk.events.event import Event

from agents.models import AdkEvent
from config.lib.refusals import Refusal
from runs.chat import turns as chat
from runs.models.ledger import AgentRun, RunStatus
from runs.rules.public_text import public_error_message
from runs.services import run as services

logger = logging.getLogger(__name__)

FOLLOW_POLL_SECONDS = 0.05
GOING_ON = (RunStatus.QUEUED, RunStatus.RUNNING)


def event_json(event: Event) -> dict:
    """An event as ADK's API server serialises it (camelCase, no internal metadata, no credential secrets)."""
    return _redact_credential_secrets(public_event(event).model_dump(exclude_none=True, by_alias=True, mode="json"))


class WireTurn(chat.ChatTurn):
    """A turn executed on this server's loop, its events queued as ADK's JSON."""

    def _push(self, event: Event) -> None:
        if event.partial:
            return  # the stored, whole event follows; the ledger's runs are not token-streamed
        self.events.put_nowait(event_json(event))


def _stored_events(run: AgentRun, seen: set[str]) -> list[dict]:
    """The run's events stored since `seen` (as stored), but the user's: its own message and answers,
    which ADK's server does not send back."""
    rows = AdkEvent.objects.of_invocation(
        app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id, invocation_id=run.invocation_id
    ).exclude(id__in=seen).values_list("id", "event_data")
    fresh: list[dict] = []
    for event_id, data in rows:
        seen.add(event_id)
        if (data or {}).get("author") != "user":
            fresh.append(data or {})
    return fresh


def seen_events(run: AgentRun) -> set[str]:
    """The run's events stored so far: a follower sends only what comes after."""
    return set(AdkEvent.objects.of_invocation(
        app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id, invocation_id=run.invocation_id
    ).values_list("id", flat=True))


async def follow_raw(run: AgentRun, seen: set[str]) -> AsyncIterator[dict]:
    """The run's new events as they are stored (ADK's stored form), until it settles or waits again."""
    while True:
        status = await AgentRun.objects.filter(pk=run.run_id).values_list("status", flat=True).aget()
        # Read after the status: a run seen settled has stored every event it will store.
        for data in await sync_to_async(_stored_events)(run, seen):
            yield data
        if status not in GOING_ON:
            return
        await asyncio.sleep(FOLLOW_POLL_SECONDS)


async def follow(run: AgentRun, seen: set[str]) -> AsyncIterator[dict]:
    """The run's new events as ADK's API server sends them, until it settles or waits again."""
    async for data in follow_raw(run, seen):
        yield event_json(Event.model_validate(data))


async def turn_events(turn: WireTurn, *, keepalive: float | None = None) -> AsyncIterator[dict | None]:
    """The turn's events as it runs (None for a keepalive tick); if another process claimed the run, followed."""
    sent: set[str] = set()
    while True:
        try:
            item = await asyncio.wait_for(turn.events.get(), keepalive) if keepalive else await turn.events.get()
        except TimeoutError:
            yield None
            continue
        if item is chat.END:
            break
        if item.get("id"):
            sent.add(item["id"])
        yield item
    if turn.task is not None:
        await asyncio.wait({turn.task})
        claimed_here = not turn.task.cancelled() and turn.task.exception() is None and turn.task.result() is not None
        if not claimed_here:
            # Claimed elsewhere (a worker got to the row first): the run is the ledger's all the same.
            async for item in follow(turn.run, sent):
                yield item


async def outcome_error(run_id: Any) -> dict | None:
    """ADK's stream error for a run that failed (its public words), else None."""
    run = await AgentRun.objects.aget(pk=run_id)
    if run.status not in (RunStatus.ERROR,):
        return None
    message = public_error_message(error_code=run.error_code, error_message=run.error_message, worker=run.worker)
    return {
        "error": f"{run.error_code}: {message}",
        "error_details": {"error_type": run.error_code, "error_message": message, "run_id": str(run.run_id)},
    }


async def cancel_followed(*, run_id: Any, actor: Any) -> None:
    """The client of a followed run left: cancel it the ledger's way (a settled run stays as it is)."""
    try:
        await sync_to_async(services.cancel_run)(run_id, actor=actor)
    except Refusal:
        pass
    except Exception:  # noqa: BLE001 - a client that left must not turn into a server error
        logger.exception("Run %s: could not cancel it after its client left", run_id)
