"""The cluster's own sweep, every few seconds: a lost machine's runs are found soon after they go stale.

The periodic job `runs.reconcile` runs at most once a minute, and django-q2's scheduler looks for
due jobs every 30 s, so a run whose machine was lost (no sentinel left to notice its worker die,
`runs.deaths`) went stale after RUN_STALE_AFTER_SECONDS and then waited up to another minute or
more: 119 s from the loss to success on default settings. Every cluster's sentinel therefore runs
the same sweep (`runs.reconcile.sweep`, then `runs.recovery.recover_due`) on a thread of its own
every `interval()` seconds: a sixth of RUN_STALE_AFTER_SECONDS, between 1 and 5 s (5 s on the
default 60 s), so a lost machine's run is continued within RUN_STALE_AFTER_SECONDS + 15 s. Several
clusters sweeping at once is safe (each write is conditional and skips rows another holds), and
costs a few index range scans per sweep when nothing is stale.

The sentinel forks a new process whenever one dies; a fork copies no other thread, so the sweep
and the fork exclude each other (`fork_guard`): a child never starts with a lock or a connection
the sweep was using at that instant.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from django.conf import settings
from django.db import close_old_connections, connection

from runs import reconcile, recovery

logger = logging.getLogger(__name__)

# Held by the sweep while it works and by the sentinel while it forks.
fork_guard = threading.Lock()


def interval() -> float:
    """Seconds between two sweeps of a cluster: recovery within RUN_STALE_AFTER_SECONDS + this + a run's start."""
    return max(1.0, min(5.0, settings.RUN_STALE_AFTER_SECONDS / 6))


def sweep_once() -> tuple[reconcile.SweepReport, int]:
    close_old_connections()
    report = reconcile.sweep()
    recovered = recovery.recover_due()
    return report, len(recovered)


def _loop(stop_event: Any) -> None:
    every = interval()
    while not stop_event.wait(every):
        with fork_guard:
            try:
                report, recovered = sweep_once()
            except Exception:  # noqa: BLE001 - the next sweep tries again
                logger.exception("The cluster's sweep failed")
                continue
        if report.reconciled or report.requeued or report.abandoned or recovered:
            logger.warning("Cluster sweep: %s, %d run(s) continued by the system", report, recovered)
    connection.close()


def start(stop_event: Any) -> threading.Thread:
    """Sweep on a daemon thread of this process until `stop_event` is set."""
    thread = threading.Thread(target=_loop, args=(stop_event,), name="run-sweeper", daemon=True)
    thread.start()
    return thread
