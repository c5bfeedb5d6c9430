"""Noticing a worker's death at once: the cluster that started it reconciles its runs then.

django-q2's sentinel (the guard of `qcluster`) checks its worker processes every half second and
starts a new one for each that died (`Sentinel.reincarnate`). That is the one place that knows,
at once, that a worker is gone: wrapped here, it reconciles the dead worker's runs (conditional
on the leases that worker held: `runs.reconcile.reconcile_dead_worker`) and lets the system
continue each of them when nothing of it is in doubt (`runs.recovery`). A lost machine, where no
sentinel is left, is still found by heartbeat staleness (`runs.reconcile`), in the sweep every
sentinel runs every few seconds (`runs.sweeper`).

The same place releases the locks of the cluster's queues the dead process (worker, pusher or
monitor) still held, without which the cluster would never deliver a task or a result again,
and a thread of the sentinel gives back the task queue's slots lost with a dead process
(`runs.queue_locks`).

django-q2 has no signal for a worker's death; the wrapper keeps its behaviour and only adds to it.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from django.db import close_old_connections
from django_q.cluster import Sentinel

from runs import queue_locks, reconcile, recovery, sweeper

logger = logging.getLogger(__name__)


def after_worker_death(*, pid: int) -> int:
    """Reconcile and recover the runs of this machine's dead worker process `pid`; how many were reconciled."""
    worker = f"{socket.gethostname()}:{pid}"
    close_old_connections()
    landed = reconcile.reconcile_dead_worker(worker=worker)
    for run in landed:
        try:
            recovery.recover(run_id=run.run_id)
        except Exception:  # noqa: BLE001 - the sweep tries again
            logger.exception("Run %s: could not be continued after its worker died", run.run_id)
    return len(landed)


_original_reincarnate = Sentinel.reincarnate


def _reincarnate(self: Sentinel, process: Any) -> None:
    pid = process.pid
    if not process.is_alive():
        # Before its replacement starts: a lock of the cluster's queues the dead process held
        # would stop every other reader or writer for good (runs.queue_locks).
        released = queue_locks.release_locks_of_dead(pid, {"task": self.task_queue, "result": self.result_queue})
        if released:
            logger.warning("Process %s died holding %s: released", pid, " and ".join(released))
    # Only a worker that is dead already: a worker the guard ends for its timeout (never ours:
    # a task lasts a claim) is still draining its runs.
    died = process is not self.monitor and process is not self.pusher and not process.is_alive()
    with sweeper.fork_guard:
        _original_reincarnate(self, process)
    if not died:
        return
    try:
        count = after_worker_death(pid=pid)
    except Exception:  # noqa: BLE001 - staleness still catches them
        logger.exception("Worker %s died; its runs could not be reconciled now", pid)
        return
    if count:
        logger.warning("Worker %s died with %d run(s): reconciled at once", pid, count)


_original_guard = Sentinel.guard


def _guard(self: Sentinel) -> None:
    # Its processes are forked already (spawn_cluster); later forks wait for the sweep's pauses.
    sweeper.start(self.stop_event)
    queue_locks.watch_task_slots(self.task_queue, self.stop_event)
    _original_guard(self)


def watch_worker_deaths() -> None:
    queue_locks.track_queue_locks()
    Sentinel.reincarnate = _reincarnate
    Sentinel.guard = _guard
