"""django-q2 task entry points of the periodic jobs: thin doors onto the services. Each is safe to run twice.

Runs and webhook events never pass through django-q2: worker processes claim them from their
tables (runs.worker.processes).
"""

from runs.inbox import processing
from runs.ledger import reconcile
from runs.schedules import services as scheduling
from runs.services import decisions
from runs.upkeep import recovery, retention, stored_data


def reconcile_runs() -> str:
    """Every minute: reconcile stale runs, continue the dead that need nobody (a backstop of the workers' sweeps)."""
    report = reconcile.sweep()
    recovered = recovery.recover_due()
    return f"{report}, {len(recovered)} run(s) continued by the system"


def purge_events() -> str:
    """Daily: delete ADK events older than EVENTS_RETENTION_DAYS, batch by batch."""
    return str(retention.purge_events())


def sweep_webhooks() -> str:
    """Every minute: wake the workers if webhook events are due (retries, expired leases, new ones)."""
    return f"{len(processing.sweep())} webhook event(s) due"


def fire_schedules() -> str:
    """Every minute: start the runs of the schedules that are due (each slot once)."""
    return str(scheduling.fire_due_schedules())


def purge_stored_inputs() -> str:
    """Daily: remove closed webhook events, their attachments and settled runs' input copies past retention."""
    return str(stored_data.purge_stored_inputs())


def expire_approvals() -> str:
    """Every minute: reject the calls that waited past APPROVAL_TIMEOUT_SECONDS; their runs go on."""
    return f"{decisions.expire_waiting()} waiting call(s) timed out"
