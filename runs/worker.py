"""Many runs in flight per worker process: the run pool, its backpressure and its drain.

A django-q2 worker process runs one task at a time, but an agent spends most of its life
waiting on a model or an API. So the `execute_run` task does not run its agent: it waits for a
free slot of this process's pool (`RUN_CONCURRENCY`), claims the run (the same atomic claim),
starts it on the process's agent loop and returns. The task is acknowledged at once; the run
lives in the pool, kept alive by the process's one heartbeat, and is settled in the `finally`
of `executor.drive` like any other run.

Why this shape (docs/architecture.md, "Many runs per worker process"):
- Backpressure: while the pool is full the task blocks, and so does its worker's dequeue; after
  RUN_SLOT_WAIT_SECONDS it hands the run back to the broker (a fresh task) for a worker with
  room, so a full worker never sits on a run another could start, nor on its stop pill.
- django-q2's `timeout` and `retry` only ever see a task that lasts a claim (or a slot wait),
  never a run: they cannot kill or redeliver a run in flight. A redelivered task finds nothing
  to claim. Recycling is off (`Q_RECYCLE`), since it would stop the process under its runs.
- A process that dies leaves its runs `running`; their shared heartbeat goes stale at once and
  one reconcile sweep settles them all.
- Drain: on SIGTERM (to the process) or its stop pill (SIGTERM to qcluster), the pool stops
  taking runs, lets them finish for RUN_DRAIN_SECONDS, then aborts the rest through ADK's abort
  signal, so each settles `error`/`worker_shutdown` with its tools listed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing.util
import os
import signal
import threading
import time
import uuid

from django.conf import settings
from django.db import connection

from agents.adk import release_process_resources, submit_coroutine
from runs import executor, lifecycle, outcomes, recovery
from runs.models import AgentRun, RunStatus

logger = logging.getLogger(__name__)

STARTED = "started"
NOT_CLAIMED = "not claimed"
HANDED_BACK = "handed back"
# After the abort, how long the drain waits for the aborted runs to write their outcome.
ABORT_SETTLE_SECONDS = 30.0


class RunPool:
    """Up to `capacity` runs of this process in flight on its agent loop."""

    def __init__(self, *, capacity: int) -> None:
        self.capacity = capacity
        self._slots = threading.BoundedSemaphore(capacity)
        # Held while a run is claimed and admitted, and when the drain begins: once draining is
        # set no claim can start, and every claim that started is in `_runs`.
        self._admission = threading.Lock()
        self._changed = threading.Condition()
        self._runs: dict[uuid.UUID, tuple[executor.RunControl, concurrent.futures.Future]] = {}
        self._draining = False
        self._drain_lock = threading.Lock()
        self._drained = threading.Event()

    @property
    def in_flight(self) -> int:
        with self._changed:
            return len(self._runs)

    @property
    def draining(self) -> bool:
        return self._draining

    def submit(self, *, run_id: uuid.UUID, wait_seconds: float) -> str:
        """Claim `run_id` and start it in the pool when a slot is free; never runs it twice.

        Blocks while the pool is full (the backpressure), at most `wait_seconds`; then, or when
        the pool is draining, hands the unclaimed run back to the broker.
        """
        deadline = time.monotonic() + wait_seconds
        while True:
            if self._draining:
                return self._hand_back(run_id, reason="this worker is stopping")
            remaining = deadline - time.monotonic()
            # Short waits, so a drain that begins meanwhile is noticed promptly.
            if self._slots.acquire(timeout=max(0.0, min(0.25, remaining))):
                break
            if remaining <= 0:
                return self._hand_back(run_id, reason=f"this worker has {self.capacity} runs in flight")
        admitted = False
        try:
            with self._admission:
                if self._draining:
                    return self._hand_back(run_id, reason="this worker is stopping")
                control = executor.RunControl(run_id)
                if not executor.begin(run_id, control):
                    return NOT_CLAIMED
                # From here the run is ours: it is settled by drive()'s finally, or, if this
                # process dies, by reconciliation.
                future = submit_coroutine(executor.drive(run_id, control))
                with self._changed:
                    self._runs[run_id] = (control, future)
                admitted = True
            future.add_done_callback(lambda done, run_id=run_id: self._finished(run_id, done))
            return STARTED
        finally:
            if not admitted:
                self._slots.release()

    def _finished(self, run_id: uuid.UUID, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            # drive() settles in its finally; an error here is the settle itself failing, which
            # leaves the run to reconciliation.
            logger.error("Run %s: the worker could not settle it", run_id, exc_info=future.exception())
        with self._changed:
            self._runs.pop(run_id, None)
            self._changed.notify_all()
        self._slots.release()

    @staticmethod
    def _hand_back(run_id: uuid.UUID, *, reason: str) -> str:
        # Only a run that is still waiting needs a task; one claimed or cancelled meanwhile does not.
        if AgentRun.objects.filter(pk=run_id, status=RunStatus.QUEUED).exists():
            lifecycle.enqueue_run(run_id)
            logger.info("Run %s handed back to the broker: %s", run_id, reason)
        return HANDED_BACK

    def _wait_until_empty(self, *, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        with self._changed:
            while self._runs:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(timeout=remaining)
        return True

    def drain(self, *, seconds: float) -> list[uuid.UUID]:
        """Stop taking runs, let them finish for `seconds`, then abort the rest; idempotent.

        Returns the runs this call aborted. A second caller waits for the first drain to end.
        """
        with self._admission:
            self._draining = True
        if not self._drain_lock.acquire(blocking=False):
            self._drained.wait()
            return []
        try:
            if self._wait_until_empty(seconds=seconds):
                return []
            with self._changed:
                remaining = [control for control, _future in self._runs.values()]
            logger.warning("Aborting %d run(s) still in flight after %g s of drain", len(remaining), seconds)
            for control in remaining:
                control.abort(outcomes.WORKER_SHUTDOWN)
            if not self._wait_until_empty(seconds=ABORT_SETTLE_SECONDS):
                logger.error("%d run(s) did not settle after their abort; reconciliation will", self.in_flight)
            return [control.run_id for control in remaining]
        finally:
            self._drained.set()


# --- The pool of this process -------------------------------------------------------------------

_state: dict[str, object] = {"pid": None, "pool": None}
_state_lock = threading.Lock()


def process_pool() -> RunPool | None:
    """This process's pool, if this process is a worker that runs a pool (else None)."""
    with _state_lock:
        return _state["pool"] if _state["pid"] == os.getpid() else None  # type: ignore[return-value]


def start_pool(*, capacity: int | None = None, handle_sigterm: bool = False) -> RunPool:
    """Make this process a pooled worker: `execute_run` then submits to its pool.

    With `handle_sigterm`, SIGTERM drains the pool and ends the process (a deploy that signals
    every process of the cluster); the pool is drained too when the process ends by itself
    (django-q2's stop pill).
    """
    with _state_lock:
        if _state["pid"] == os.getpid() and _state["pool"] is not None:
            return _state["pool"]  # type: ignore[return-value]
        pool = RunPool(capacity=capacity or settings.RUN_CONCURRENCY)
        _state.update(pid=os.getpid(), pool=pool)
    if handle_sigterm and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    # multiprocessing runs finalizers when a worker's target returns (its loop read STOP),
    # before the process exits: the place to drain, since atexit does not run there.
    multiprocessing.util.Finalize(None, _drain_at_exit, exitpriority=100)
    return pool


def drain_process_pool() -> list[uuid.UUID]:
    pool = process_pool()
    if pool is None:
        return []
    aborted = pool.drain(seconds=settings.RUN_DRAIN_SECONDS)
    for run_id in aborted:
        # Each aborted run settled worker_shutdown with its tools listed: the system continues it
        # in another worker when nothing of it is in doubt (runs.recovery).
        try:
            recovery.recover(run_id=run_id)
        except Exception:  # noqa: BLE001 - the sweep tries again
            logger.exception("Run %s: could not be continued after the drain", run_id)
    release_process_resources()
    connection.close()
    return aborted


def _drain_at_exit() -> None:
    try:
        drain_process_pool()
    except Exception:  # noqa: BLE001 - the process is ending; what is not settled is reconciled
        logger.exception("The drain at exit failed")


def _on_sigterm(signum: int, frame: object) -> None:
    # Not in the handler itself: the main thread may be inside a query or the broker's queue.
    logger.warning("SIGTERM: draining %d run(s) for up to %g s", _in_flight(), settings.RUN_DRAIN_SECONDS)

    def drain_and_exit() -> None:
        _drain_at_exit()
        os._exit(0)

    threading.Thread(target=drain_and_exit, name="run-drain").start()


def _in_flight() -> int:
    pool = process_pool()
    return pool.in_flight if pool is not None else 0


def on_worker_spawned(**_kwargs: object) -> None:
    """django-q2's `post_spawn`: each worker process of a cluster runs a pool."""
    start_pool(handle_sigterm=True)
