"""django-q2 task entry points: thin doors onto the services. Each is safe to run twice."""

import uuid

from django.conf import settings

from runs import approvals, executor, reconcile, recovery, retention, stored_data, worker
from runs.inbox import processing
from runs.schedules import services as scheduling


def execute_run(run_id: str) -> str:
    """In a cluster's worker: claim the run into the process's pool and return (runs.worker).

    Anywhere else (a synchronous queue, a shell): claim, run and settle it before returning.
    """
    pool = worker.process_pool()
    if pool is not None:
        return pool.submit(run_id=uuid.UUID(str(run_id)), wait_seconds=settings.RUN_SLOT_WAIT_SECONDS)
    return executor.execute(uuid.UUID(str(run_id)))


def reconcile_runs() -> str:
    """Every minute: reconcile stale runs, enqueue lost queued runs again, continue the dead that need nobody."""
    report = reconcile.sweep()
    recovered = recovery.recover_due()
    return f"{report}, {len(recovered)} run(s) continued by the system"


def purge_events() -> str:
    """Daily: delete ADK events older than EVENTS_RETENTION_DAYS, batch by batch."""
    return str(retention.purge_events())


def process_webhook_event(event_id: str) -> str:
    """Claim one inbox event, run its attempt and settle it (does nothing if it is not due)."""
    return processing.process_event(event_id=uuid.UUID(str(event_id)))


def sweep_webhooks() -> str:
    """Every minute: enqueue due webhook retries, expired leases and events whose task was lost."""
    return f"{len(processing.sweep())} webhook event(s) enqueued"


def fire_schedules() -> str:
    """Every minute: start the runs of the schedules that are due (each slot once)."""
    return str(scheduling.fire_due_schedules())


def purge_stored_inputs() -> str:
    """Daily: remove closed webhook events, their attachments and settled runs' input copies past retention."""
    return str(stored_data.purge_stored_inputs())


def expire_approvals() -> str:
    """Every minute: reject the calls that waited past APPROVAL_TIMEOUT_SECONDS; their runs go on."""
    return f"{approvals.expire_waiting()} waiting call(s) timed out"
