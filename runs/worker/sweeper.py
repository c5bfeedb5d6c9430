"""Each worker process's own sweep, every few seconds: dead processes' runs are found and continued.

The periodic job `runs.ledger.reconcile` runs at most once a minute (django-q2's scheduler looks for due
jobs every 30 s), and it is a backstop: every `runworker` process sweeps on a thread of its own
every `interval()` seconds (a sixth of RUN_STALE_AFTER_SECONDS, between 1 and 5 s):

- the runs of `runworker` processes whose advisory lock is gone (`runs.ledger.presence`, PostgreSQL):
  reconciled at once, conditional on their lease, whatever machine they ran on;
- stale runs (`runs.ledger.reconcile.sweep`), the last line for everything else;
- then every death that needs nobody is continued (`runs.upkeep.recovery.recover_due`).

Several processes sweeping at once is safe (each write is conditional and skips rows another
holds) and costs a few index range scans per sweep when nothing is stale.
"""

from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import close_old_connections, connection

from runs.ledger import presence, reconcile
from runs.upkeep import recovery

logger = logging.getLogger(__name__)


def interval() -> float:
    """Seconds between two sweeps of a process: recovery within RUN_STALE_AFTER_SECONDS + this + a run's start."""
    return max(1.0, min(5.0, settings.RUN_STALE_AFTER_SECONDS / 6))


def reconcile_gone_workers(*, me: str = "") -> int:
    """Reconcile the runs of every `runworker` process whose lock is gone; how many landed."""
    landed = 0
    for worker in presence.gone_workers(exclude=me):
        runs = reconcile.reconcile_dead_worker(worker=worker, why=reconcile.LOCK_GONE)
        if runs:
            logger.warning("Worker %s is gone (its lock was released): %d run(s) reconciled", worker, len(runs))
        landed += len(runs)
    return landed


def sweep_once(*, me: str = "") -> tuple[reconcile.SweepReport, int, int]:
    close_old_connections()
    gone = reconcile_gone_workers(me=me)
    report = reconcile.sweep()
    recovered = recovery.recover_due()
    return report, gone, len(recovered)


def _loop(stop_event: threading.Event, me: str) -> None:
    every = interval()
    while not stop_event.wait(every):
        try:
            report, gone, recovered = sweep_once(me=me)
        except Exception:  # noqa: BLE001 - the next sweep tries again
            logger.exception("The worker's sweep failed")
            continue
        if report.reconciled or report.abandoned or gone or recovered:
            logger.warning("Worker sweep: %s, %d run(s) of gone workers reconciled, %d run(s) continued by the system",
                           report, gone, recovered)
    connection.close()


def start(stop_event: threading.Event, *, me: str = "") -> threading.Thread:
    """Sweep on a daemon thread of this process until `stop_event` is set."""
    thread = threading.Thread(target=_loop, args=(stop_event, me), name="run-sweeper", daemon=True)
    thread.start()
    return thread
