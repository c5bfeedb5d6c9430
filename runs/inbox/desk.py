"""The inbox desk's rules: retry now, force reprocess, mark resolved (the admin actions are doors onto these).

Who may: processing an event again (retry, force) is a replay of a run nobody in particular
started, so it needs `runs.replay_agentrun` (forcing needs `runs.force_replay_agentrun` on top);
closing an event needs `runs.resolve_webhookevent`.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.contrib.admin.models import CHANGE, LogEntry
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from config.lib.refusals import Refusal
from runs.inbox import receipt
from runs.inbox.attempts import files_follow_transaction, last_run, start_attempt, update_event
from runs.inbox.refusals import (
    EventClosed,
    EventInFlight,
    EventNotFound,
    NothingToResolve,
)
from runs.ledger import reconcile
from runs.models.inbox import EventStatus, WebhookEvent
from runs.models.ledger import AgentRun
from runs.rules import permissions
from runs.rules import replay as rules
from runs.services import run as services

logger = logging.getLogger(__name__)

# --- The inbox desk: retry now, force reprocess, mark resolved -------------------------------------


def _locked_event(event_id: Any) -> WebhookEvent:
    try:
        return WebhookEvent.objects.select_for_update().select_related("source").get(pk=event_id)
    except (WebhookEvent.DoesNotExist, ValidationError, ValueError):
        raise EventNotFound(event_id) from None


def _locked_idle_event(event_id: Any) -> WebhookEvent:
    """The event, locked, unless a worker is processing it now (then a person waits)."""
    event = _locked_event(event_id)
    if event.status == EventStatus.PROCESSING:
        raise EventInFlight()
    return event


def _hand_to_worker(event: WebhookEvent, now: datetime) -> None:
    """The run is written; a worker executes it: the lease is left expired so any worker can claim it."""
    update_event(event, status=EventStatus.PROCESSING, lease_expires_at=now, leased_by="", next_attempt_at=None)
    receipt.announce_event(event.event_id)


def _log(actor: Any, obj: Any, flag: int, message: str) -> None:

    if getattr(actor, "pk", None) is not None:
        LogEntry.objects.log_actions(actor.pk, [obj], flag, message, single_object=True)


def retry_event(event_id: Any, *, actor: Any) -> AgentRun:
    """Process the event again now, if the replay rules allow it (a person's “Retry now”).

    The attempts ceiling does not apply: a person asked. Returns the new run.
    """
    permissions.check_may_retry_events(actor=actor)
    now = timezone.now()
    with files_follow_transaction(), transaction.atomic():
        event = _locked_idle_event(event_id)
        if event.status in {EventStatus.DONE, EventStatus.RESOLVED}:
            raise EventClosed(event.get_status_display())
        previous = last_run(event)
        if previous is not None:
            reconcile.reconcile_run_if_stale(previous)
            decision = rules.decide(previous, force=False)
            if decision.refusal is not None:
                raise decision.refusal
        run = start_attempt(event, previous=previous, now=now)
        if run is None:
            raise Refusal(event.last_error)
        _hand_to_worker(event, now)
        _log(actor, event, CHANGE, f"Retried now as run {run.run_id} (attempt {event.attempts}).")
    return run


def force_reprocess_event(event_id: Any, *, actor: Any, reason: str) -> AgentRun:
    """Process the event again even where the rules refuse (tools called, unknown, done, resolved)."""
    reason = services.check_force(actor=actor, reason=reason)
    permissions.check_may_retry_events(actor=actor)
    now = timezone.now()
    with files_follow_transaction(), transaction.atomic():
        event = _locked_idle_event(event_id)
        previous = last_run(event)
        overridden = ""
        if previous is not None:
            reconcile.reconcile_run_if_stale(previous)
            decision = rules.decide(previous, force=True)
            if decision.refusal is not None:
                raise decision.refusal
            overridden = decision.overridden.code if decision.overridden is not None else ""
        if not overridden and event.status in {EventStatus.DONE, EventStatus.RESOLVED}:
            overridden = f"event_{event.status}"
        forced = bool(overridden)
        run = start_attempt(
            event, previous=previous, now=now, forced_by=actor if forced else None, force_reason=reason if forced else ""
        )
        if run is None:
            raise Refusal(event.last_error)
        _hand_to_worker(event, now)
        what = f", overriding “{overridden}”" if forced else ""
        _log(actor, event, CHANGE, f"Force-reprocessed as run {run.run_id}{what}. Reason: {reason}")
        if forced:
            _log(actor, run, CHANGE, f"Started by forcing webhook event {event.event_id}{what}. Reason: {reason}")
    return run


def resolve_event(event_id: Any, *, actor: Any) -> WebhookEvent:
    """A person handled the event (or decided it needs nothing more): it is closed, never retried."""
    permissions.check_may_resolve_events(actor=actor)
    now = timezone.now()
    with transaction.atomic():
        event = _locked_idle_event(event_id)
        if event.status in {EventStatus.DONE, EventStatus.RESOLVED}:
            raise NothingToResolve(event.get_status_display())
        was = event.get_status_display()
        update_event(event, status=EventStatus.RESOLVED, lease_expires_at=None, leased_by="", next_attempt_at=None,
             finished_at=now, resolved_by=actor if getattr(actor, "is_authenticated", False) else None)
        _log(actor, event, CHANGE, f"Marked resolved (it was {was}).")
    return event
