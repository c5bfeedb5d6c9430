"""Caps on work in flight per user: runs queued or running, and chat streams open.

Counted from the ledger itself (rows created_by the user, still queued or running), so the cap
holds across web replicas and workers. The check runs inside the transaction that writes the
new run, after locking the user's row: two simultaneous starts by one user are serialised
(on SQLite the IMMEDIATE transaction already is), so the cap is never overshot.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model

from config.lib.refusals import Refusal
from runs.models.ledger import IN_FLIGHT, STREAMED_TRIGGERS, AgentRun


class TooManyRunsInFlight(Refusal):
    status = 429
    code = "too_many_runs_in_flight"


class TooManyChatStreams(Refusal):
    status = 429
    code = "too_many_chat_streams"


def check_in_flight(*, user: Any, chat: bool = False) -> None:
    """Raise a 429 refusal if `user` may not start one more run (a chat turn when `chat`)."""
    if user is None or not getattr(user, "is_authenticated", False):
        return  # webhook and schedule runs belong to no user; their own rules pace them
    run_cap = settings.MAX_RUNS_IN_FLIGHT_PER_USER
    stream_cap = settings.MAX_CHAT_STREAMS_PER_USER if chat else 0
    if not run_cap and not stream_cap:
        return
    list(get_user_model().objects.select_for_update().filter(pk=user.pk).values_list("pk", flat=True))
    in_flight = AgentRun.objects.filter(created_by=user, status__in=IN_FLIGHT)
    if run_cap:
        count = in_flight.count()
        if count >= run_cap:
            raise TooManyRunsInFlight(
                f"You already have {count} runs queued or running, the most one user may have at once "
                f"(MAX_RUNS_IN_FLIGHT_PER_USER={run_cap}). Wait for some to finish, or cancel them.",
                limit=run_cap,
            )
    if stream_cap:
        # A chat turn is in flight exactly while its stream is open: closing the stream cancels it.
        count = in_flight.filter(trigger__in=STREAMED_TRIGGERS).count()
        if count >= stream_cap:
            raise TooManyChatStreams(
                f"You already have {count} chat turns streaming, the most one user may have open at once "
                f"(MAX_CHAT_STREAMS_PER_USER={stream_cap}). Close one, or wait for it to finish.",
                limit=stream_cap,
            )
