"""Processing the inbox: events leased by workers, processed by runs, retried only when harmless.

Receipt (`receive_event`): the signature is checked on the raw body, the attachments are copied
to disk and the event row is written *before* the provider hears 202; the same provider
message id again answers with the first event (the unique constraint decides races).

Processing (`process_event`, `claim_next`): a worker leases the event (`SELECT … FOR UPDATE SKIP
LOCKED` on PostgreSQL; on SQLite a conditional UPDATE inside an IMMEDIATE transaction, which
serialises writers) and, under that row lock, judges the event's last run:

* no run yet → start one (trigger `webhook`) and execute it in this worker;
* a run still queued → execute it (its claim is atomic, so it runs once);
* a run still running with a live heartbeat → leave it alone and look again when the lease ends;
  a run whose heartbeat went silent is reconciled first, then judged as the failure it is;
* a success → the event is `done`;
* a failure → `runs.rules.replay.decide(run, force=False)`: if the run provably called no tool that
  acts (none, or read-only ones only) the event waits for its next retry (`retry_wait`, backing
  off) or, past WEBHOOK_MAX_ATTEMPTS, is `dead`; otherwise it `needs_review`, saying what was
  called, and waits for a person.

A new run is only ever started under the event's row lock after its previous run has settled,
and a partial unique index on `agent_runs(webhook_event)` for queued/running rows makes "two
runs in flight for one event" impossible even for a path that forgot the rules.

Every worker process claims due events from this table (`claim_next`, runs.worker.processes's inbox loop),
woken by a notification when one arrives (runs.ledger.wakeup) and polling besides. The worker that
executes a run observes its outcome itself right after; a worker that dies mid-event stops
renewing its lease, and whoever claims the expired lease settles the event from the run's outcome. Every
transition is conditional on the event's state under its row lock, so doing it twice is harmless.

"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import Q
from django.utils import timezone

from config.lib.refusals import Refusal
from runs.execution import executor
from runs.inbox.attempts import files_follow_transaction, last_run, start_attempt, update_event
from runs.inbox.refusals import REVIEW_HINT, event_wording
from runs.ledger import lifecycle, reconcile, wakeup
from runs.models.inbox import EventStatus, WebhookEvent
from runs.models.ledger import AgentRun, RunStatus
from runs.refusals import ALREADY_CONTINUED, STILL_GOING, ReplayRefused, ToolsCalled, ToolsUnknown
from runs.rules import replay as rules

logger = logging.getLogger(__name__)


# --- Processing ------------------------------------------------------------------------------------


def retry_delay(attempt: int) -> int:
    """Seconds before the retry that follows failed attempt `attempt` (1-based); the last delay repeats."""
    delays = settings.WEBHOOK_RETRY_DELAYS
    return delays[min(max(attempt, 1), len(delays)) - 1]


def claimable_q(now: datetime) -> Q:
    """Events a worker may take now: new, due for a retry, or left by a worker whose lease ran out."""
    return (
        Q(status=EventStatus.RECEIVED)
        | Q(status=EventStatus.RETRY_WAIT, next_attempt_at__lte=now)
        | Q(status=EventStatus.PROCESSING, lease_expires_at__lt=now)
    )


def _short(run: AgentRun) -> str:
    return str(run.run_id)[:8]


def review_message(event: WebhookEvent, run: AgentRun, refusal: Refusal) -> str:
    attempt = f"Attempt {event.attempts} (run {_short(run)})"
    if isinstance(refusal, ToolsCalled):
        return (
            f"{attempt} called {', '.join(refusal.context['tools'])} before failing: processing the event again "
            f"would call them again. {REVIEW_HINT}"
        )
    if isinstance(refusal, ToolsUnknown):
        return (
            f"{attempt} failed and it is unknown whether it called any tool before failing (unknown is not "
            f"none): processing the event again could repeat a side effect. {REVIEW_HINT}"
        )
    sentence = refusal.sentence if isinstance(refusal, ReplayRefused) else refusal.admin_detail
    return f"{attempt} cannot simply be repeated: {sentence} {REVIEW_HINT}"


def _run_failure(run: AgentRun) -> str:
    return f"{run.error_code or run.status}: {run.error_message or 'no message'}"


def _advance(event: WebhookEvent, *, was: str, now: datetime) -> uuid.UUID | None:
    """Move a leased event on from what its last run says; return the run this worker must execute."""
    previous = last_run(event)
    if previous is None:
        run = start_attempt(event, previous=None, now=now)
        return run.run_id if run is not None else None


    # A run whose worker died is judged as what it is: a failure whose outcome is unknown.
    reconcile.reconcile_run_if_stale(previous)
    if previous.status == RunStatus.QUEUED:
        return previous.run_id
    if previous.status in (RunStatus.RUNNING, RunStatus.WAITING):
        # Its worker is alive (the heartbeat is fresh), or it waits for a decision (the event waits
        # with it): look again when this lease runs out.
        return None
    if previous.status == RunStatus.SUCCESS:
        update_event(event, status=EventStatus.DONE, last_error="", lease_expires_at=None, leased_by="", finished_at=now)
        return None

    decision = rules.decide(previous, force=False)
    refusal = decision.refusal
    if refusal is not None:
        if isinstance(refusal, STILL_GOING):
            return None
        if isinstance(refusal, ALREADY_CONTINUED):
            update_event(event, status=EventStatus.DONE, last_error=event_wording(refusal),
                 lease_expires_at=None, leased_by="", finished_at=now)
            return None
        update_event(event, status=EventStatus.NEEDS_REVIEW, last_error=review_message(event, previous, refusal),
             lease_expires_at=None, leased_by="", next_attempt_at=None, finished_at=None)
        logger.warning("Webhook event %s needs review: %s", event.event_id, event.last_error)
        return None

    # The previous attempt provably touched nothing: it may be retried.
    if event.attempts >= settings.WEBHOOK_MAX_ATTEMPTS:
        update_event(event, status=EventStatus.DEAD, lease_expires_at=None, leased_by="", next_attempt_at=None,
             finished_at=now, last_error=(
                 f"Gave up after {event.attempts} attempts (WEBHOOK_MAX_ATTEMPTS="
                 f"{settings.WEBHOOK_MAX_ATTEMPTS}), none of which called a tool. The last one (run "
                 f"{_short(previous)}) failed with {_run_failure(previous)}"
             ))
        logger.warning("Webhook event %s is dead: %s", event.event_id, event.last_error)
        return None
    if was == EventStatus.RETRY_WAIT:
        run = start_attempt(event, previous=previous, now=now)
        return run.run_id if run is not None else None
    delay = retry_delay(event.attempts)
    due = now + timedelta(seconds=delay)
    update_event(event, status=EventStatus.RETRY_WAIT, next_attempt_at=due, lease_expires_at=None, leased_by="",
         last_error=(
             f"Attempt {event.attempts} (run {_short(previous)}) failed with {_run_failure(previous)} "
             f"It called no tool{' that acts (only read-only ones)' if previous.tools_executed else ''}, "
             f"so it is retried in {delay} s."
         ))
    return None


@dataclass(frozen=True)
class Claim:
    event_id: uuid.UUID
    worker: str
    run_id: uuid.UUID | None
    status: str


def _take(queryset, *, worker: str, now: datetime) -> Claim | None:
    """Lease the first claimable event of `queryset` and advance it, in one transaction."""
    with files_follow_transaction(), transaction.atomic():
        event = (
            queryset.select_for_update(skip_locked=True, of=("self",))
            .filter(claimable_q(now))
            .select_related("source")
            .first()
        )
        if event is None:
            return None
        was = event.status
        # Conditional on what was read: on SQLite (no row locks) the IMMEDIATE transaction already
        # serialises claimants, and the row count keeps the claim honest anywhere.
        taken = WebhookEvent.objects.filter(
            pk=event.pk, status=was, lease_expires_at=event.lease_expires_at
        ).update(
            status=EventStatus.PROCESSING,
            lease_expires_at=now + timedelta(seconds=settings.WEBHOOK_LEASE_SECONDS),
            leased_by=worker,
        )
        if not taken:
            return None
        event.status = EventStatus.PROCESSING
        event.leased_by = worker
        run_id = _advance(event, was=was, now=now)
        return Claim(event.event_id, worker, run_id, event.status)


def claim_event(*, event_id: Any, worker: str, now: datetime | None = None) -> Claim | None:
    """Lease this event if it is claimable now (and nobody holds its row); None otherwise."""
    return _take(WebhookEvent.objects.filter(pk=event_id), worker=worker, now=now or timezone.now())


def claim_next(*, worker: str, now: datetime | None = None) -> Claim | None:
    """Lease the next claimable event, skipping rows other workers hold.

    One scan per kind of due event, each a range on its own index, rather than one OR over the
    table that the planner could answer by walking every settled event. Due retries and expired
    leases go first: they are few, and new events keep arriving.
    """
    now = now or timezone.now()
    scans = (
        WebhookEvent.objects.filter(status=EventStatus.RETRY_WAIT, next_attempt_at__lte=now).order_by("next_attempt_at"),
        WebhookEvent.objects.filter(status=EventStatus.PROCESSING, lease_expires_at__lt=now).order_by("lease_expires_at"),
        WebhookEvent.objects.filter(status=EventStatus.RECEIVED).order_by("next_attempt_at"),
    )
    for scan in scans:
        claim = _take(scan, worker=worker, now=now)
        if claim is not None:
            return claim
    return None


class LeaseKeeper:
    """Renews a worker's lease on an event while it executes the event's run (a plain thread,
    like the run's heartbeat, so a busy event loop cannot make a live worker look gone)."""

    def __init__(self, event_id: uuid.UUID, worker: str):
        self.event_id, self.worker = event_id, worker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{event_id}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        period = settings.WEBHOOK_LEASE_SECONDS / 3
        try:
            while not self._stop.wait(period):
                try:
                    renewed = WebhookEvent.objects.filter(
                        pk=self.event_id, status=EventStatus.PROCESSING, leased_by=self.worker
                    ).update(lease_expires_at=timezone.now() + timedelta(seconds=settings.WEBHOOK_LEASE_SECONDS))
                except Exception:  # noqa: BLE001 - a hiccup must not stop the run; the next try may work
                    logger.exception("Webhook event %s: the lease could not be renewed", self.event_id)
                    close_old_connections()
                    continue
                if not renewed:
                    return  # someone else moved the event on; nothing left to keep
        finally:
            connection.close()


def _after_run(claim: Claim) -> str:
    """Settle the event from the outcome of the run this worker just executed."""
    now = timezone.now()
    with files_follow_transaction(), transaction.atomic():
        event = WebhookEvent.objects.select_for_update().select_related("source").filter(pk=claim.event_id).first()
        if event is None or event.status != EventStatus.PROCESSING:
            return event.status if event is not None else "gone"
        current = last_run(event)
        if current is None or current.run_id != claim.run_id:
            return event.status  # another attempt was started meanwhile; it is someone else's now
        _advance(event, was=EventStatus.PROCESSING, now=now)
        return event.status


def work(claim: Claim) -> str:
    """Execute the claimed event's run here, then settle the event; returns its status."""

    if claim.run_id is None:
        return claim.status
    with LeaseKeeper(claim.event_id, claim.worker):
        if executor.execute(claim.run_id) == executor.NOT_CLAIMED:
            # A worker claimed the queued run from the ledger first: its outcome is awaited here,
            # under this event's lease, rather than a lease period later by whoever takes it next.
            _wait_while_running(claim.run_id)
    return _after_run(claim)


def _wait_while_running(run_id: uuid.UUID) -> None:
    while True:
        run = AgentRun.objects.filter(pk=run_id).first()
        if run is None or run.status != RunStatus.RUNNING or reconcile.reconcile_run_if_stale(run):
            return
        time.sleep(WAIT_POLL_SECONDS)


# How often an event's worker looks at a run another worker claimed, until it settles.
WAIT_POLL_SECONDS = 0.5


def process_event(*, event_id: Any, worker: str | None = None) -> str:
    """The task's body: claim the event, run its attempt, settle it. Safe to call any number of times."""
    claim = claim_event(event_id=event_id, worker=worker or lifecycle.worker_name())
    if claim is None:
        return "not claimed"
    return work(claim)


def process_due(*, worker: str | None = None, limit: int | None = None, stop: threading.Event | None = None) -> int:
    """Process claimable events one after another until none is left (or `limit`, or `stop`); how many."""
    worker = worker or lifecycle.worker_name()
    done = 0
    while (limit is None or done < limit) and not (stop is not None and stop.is_set()):
        claim = claim_next(worker=worker)
        if claim is None:
            break
        work(claim)
        done += 1
    return done


# --- The sweeper -----------------------------------------------------------------------------------


def sweep(*, now: datetime | None = None) -> list[uuid.UUID]:
    """Every minute: wake the workers if events are due (retries, expired leases, new ones); the due ones.

    A backstop only: every worker process's inbox loop claims events from their table and polls
    besides; the notification shortens a wait, it never carries the event.
    """
    now = now or timezone.now()
    due = list(WebhookEvent.objects.filter(claimable_q(now)).order_by().values_list("pk", flat=True)[:SWEEP_REPORTED])
    if due:
        wakeup.notify(wakeup.INBOX_CHANNEL)
    return due


# Due events a sweep names at most (in its report); it wakes the workers for all of them.
SWEEP_REPORTED = 1000
