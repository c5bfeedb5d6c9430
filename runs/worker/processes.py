"""Worker processes: runs claimed from the ledger, many in flight per process, drained on SIGTERM.

The run table is the queue (DESIGN §20). A worker process (`serve_worker_process`, one child of
`manage.py runworker`) claims `queued` runs, only as many as it has free slots
(`RUN_CONCURRENCY` minus its runs in flight), in one statement (`lifecycle.claim_queued_runs`),
and starts each on its agent loop (`executor.drive`), where it is kept alive by the process's one
heartbeat and settled in `drive`'s `finally` like any other run. Backpressure is the claim's
LIMIT: a full process claims nothing, and the rest of a backlog stays claimable by others.

It wakes up when told (PostgreSQL NOTIFY on its listener connection, `runs.ledger.wakeup`), when one of
its runs ends (a slot freed), and every RUN_POLL_SECONDS regardless, so a lost notification only
delays a run. Beside the claim loop it runs its heartbeat, its sweep (`runs.worker.sweeper`) and an inbox
loop that claims due webhook events from their table (`runs.inbox.processing`).

Drain: on SIGTERM the process stops claiming, lets its runs finish for RUN_DRAIN_SECONDS, then
aborts the rest through ADK's abort signal, so each settles `error`/`worker_shutdown` with its
tools listed, and the system continues those that need nobody (runs.upkeep.recovery).

A process that dies leaves its runs `running`: its parent sees it at once (`Supervisor`,
`waitpid`), another machine sees its advisory lock go (`runs.ledger.presence`), and staleness is the last
line; each reconciles them conditional on their lease, and recovery continues them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import select
import signal
import threading
import time
import uuid

from django.conf import settings
from django.db import close_old_connections, connection, connections

from agents.adk import release_process_resources, submit_coroutine
from runs.execution import executor
from runs.inbox import processing
from runs.ledger import lifecycle, outcomes, presence, reconcile, wakeup
from runs.upkeep import recovery
from runs.worker import sweeper

logger = logging.getLogger(__name__)

# After the abort, how long the drain waits for the aborted runs to write their outcome.
ABORT_SETTLE_SECONDS = 30.0


class RunPool:
    """Up to `capacity` runs of this process in flight on its agent loop."""

    def __init__(self, *, capacity: int, on_slot_freed=None) -> None:
        self.capacity = capacity
        # Held while runs are claimed and admitted, and when the drain begins: once draining is
        # set no claim can start, and every claim that started is in `_runs`.
        self._admission = threading.Lock()
        self._changed = threading.Condition()
        self._runs: dict[uuid.UUID, tuple[executor.RunControl, concurrent.futures.Future]] = {}
        self._draining = False
        self._drain_lock = threading.Lock()
        self._drained = threading.Event()
        self._on_slot_freed = on_slot_freed

    @property
    def in_flight(self) -> int:
        with self._changed:
            return len(self._runs)

    @property
    def free(self) -> int:
        return 0 if self._draining else max(0, self.capacity - self.in_flight)

    @property
    def draining(self) -> bool:
        return self._draining

    def claim(self, *, worker: str) -> int:
        """Claim as many queued runs as there are free slots and start them; how many were claimed."""
        with self._admission:
            free = self.free
            if free <= 0:
                return 0
            claimed = lifecycle.claim_queued_runs(worker=worker, limit=free)
            for run in claimed:
                self.adopt(run)
            return len(claimed)

    def adopt(self, run) -> None:
        """Start a run this process claimed; from here it is settled by drive()'s finally, or, if
        this process dies, by reconciliation."""
        control = executor.RunControl(run.run_id)
        executor.adopt(run, control)
        future = submit_coroutine(executor.drive(run.run_id, control))
        with self._changed:
            self._runs[run.run_id] = (control, future)
        future.add_done_callback(lambda done, run_id=run.run_id: self._finished(run_id, done))

    def _finished(self, run_id: uuid.UUID, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            # drive() settles in its finally; an error here is the settle itself failing, which
            # leaves the run to reconciliation.
            logger.error("Run %s: the worker could not settle it", run_id, exc_info=future.exception())
        with self._changed:
            self._runs.pop(run_id, None)
            self._changed.notify_all()
        if self._on_slot_freed is not None:
            self._on_slot_freed()

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


def continue_aborted(run_ids: list[uuid.UUID]) -> None:
    """Each run a drain aborted settled worker_shutdown with its tools listed: the system continues
    it in another worker when nothing of it is in doubt (runs.upkeep.recovery)."""
    for run_id in run_ids:
        try:
            recovery.recover(run_id=run_id)
        except Exception:  # noqa: BLE001 - the sweep tries again
            logger.exception("Run %s: could not be continued after the drain", run_id)


# --- One worker process ---------------------------------------------------------------------------


class WorkerProcess:
    """The claim loop of one worker process, with its listener, sweep and inbox loop."""

    def __init__(self, *, capacity: int | None = None, parent_pid: int | None = None) -> None:
        self.listener = wakeup.Listener(on_connect=self._take_lock)
        if self.listener.enabled:
            # Its claims carry a name others may judge by its lock (runs.ledger.presence).
            lifecycle.become_runworker_process()
        self.name = lifecycle.worker_name()
        self.parent_pid = parent_pid
        self.stopping = threading.Event()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        os.set_blocking(self._wake_read, False)
        self.pool = RunPool(capacity=capacity or settings.RUN_CONCURRENCY, on_slot_freed=self.wake)
        # Without its lock (PostgreSQL) the process claims nothing: another would judge its runs dead.
        self.may_claim = not self.listener.enabled
        self.inbox_due = threading.Event()

    def _take_lock(self, listener_connection) -> None:
        self.may_claim = presence.take(listener_connection, self.name)
        if not self.may_claim:
            logger.error("Worker %s could not take its lock (another live process's name hashes the same); "
                         "it claims nothing until it can", self.name)

    def wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def stop(self) -> None:
        self.stopping.set()
        self.inbox_due.set()
        self.wake()

    def _wait(self, seconds: float) -> set[str]:
        """Until a notification, a wake-up (a slot freed, a stop) or `seconds`; the channels notified."""
        fds = [self._wake_read]
        if self.listener.enabled:
            try:
                self.listener.connect()
            except Exception:  # noqa: BLE001 - the poll covers what a missing listener misses
                logger.warning("Worker %s: no listener connection; polling", self.name, exc_info=True)
        listening = self.listener.connection is not None
        if self.listener.enabled and not listening:
            # Its lock went with the connection: claims now would be judged dead by the others.
            self.may_claim = False
        if listening:
            fds.append(self.listener.connection.fileno())
        readable, _, _ = select.select(fds, [], [], seconds)
        if self._wake_read in readable:
            try:
                while os.read(self._wake_read, 4096):
                    pass
            except BlockingIOError:
                pass
        if listening:
            channels = self.listener.wait(0)
            if self.listener.connection is None:
                self.may_claim = False  # it failed just now, and its lock with it
            return channels
        return set()

    def run(self) -> None:
        """Claim and run until stopped (SIGTERM, or the parent gone), then drain."""
        logger.info("Worker %s: claiming up to %d run(s) at once", self.name, self.pool.capacity)
        sweeping = sweeper.start(self.stopping, me=self.name)
        inbox = threading.Thread(target=self._inbox_loop, name="inbox", daemon=True)
        inbox.start()
        poll = settings.RUN_POLL_SECONDS
        try:
            if self.listener.enabled:
                try:
                    self.listener.connect()  # its lock first: then its first claim
                except Exception:  # noqa: BLE001 - retried at every wait
                    logger.warning("Worker %s: no listener connection yet", self.name, exc_info=True)
            while not self.stopping.is_set():
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.warning("Worker %s: its parent is gone; stopping", self.name)
                    break
                if self.may_claim:
                    self._claim_all()
                channels = self._wait(poll)
                if wakeup.INBOX_CHANNEL in channels:
                    self.inbox_due.set()
        finally:
            self.stopping.set()
            self.inbox_due.set()
            aborted = self.pool.drain(seconds=settings.RUN_DRAIN_SECONDS)
            continue_aborted(aborted)
            inbox.join(timeout=ABORT_SETTLE_SECONDS)
            sweeping.join(timeout=5)
            self.listener.close()
            release_process_resources()
            connections.close_all()

    def _claim_all(self) -> None:
        try:
            while self.pool.free > 0 and not self.stopping.is_set():
                wanted = self.pool.free
                if self.pool.claim(worker=self.name) < wanted:
                    return
        except Exception:  # noqa: BLE001 - a database hiccup: the next wake-up or poll tries again
            logger.exception("Worker %s: claiming failed", self.name)
            close_old_connections()

    def _inbox_loop(self) -> None:
        """Claim due webhook events from their table one at a time, each executed here (its run on the agent loop)."""
        try:
            while not self.stopping.is_set():
                try:
                    if self.may_claim:
                        processing.process_due(worker=self.name, limit=100, stop=self.stopping)
                except Exception:  # noqa: BLE001 - the next round tries again
                    logger.exception("Worker %s: the inbox round failed", self.name)
                    close_old_connections()
                self.inbox_due.wait(settings.RUN_POLL_SECONDS)
                self.inbox_due.clear()
        finally:
            connection.close()


def serve_worker_process(*, parent_pid: int | None = None, capacity: int | None = None) -> None:
    """This process becomes a worker until SIGTERM (drained) or its parent's death."""
    # Connections kept for the process's life, checked after an error (close_old_connections):
    # a worker opens one per thread, not one per run.
    for alias in connections:
        connections[alias].settings_dict["CONN_MAX_AGE"] = None
    worker = WorkerProcess(capacity=capacity, parent_pid=parent_pid)
    signal.signal(signal.SIGTERM, lambda signum, frame: worker.stop())
    signal.signal(signal.SIGINT, lambda signum, frame: worker.stop())
    worker.run()


# --- The parent: N worker processes, each death noticed at once ------------------------------------


def after_worker_death(*, pid: int) -> int:
    """Reconcile and recover the runs of this machine's dead worker process `pid`; how many were reconciled."""
    close_old_connections()
    landed = [
        run
        for name in {lifecycle.runworker_name(pid=pid), f"{lifecycle.worker_host()}:{pid}"}
        for run in reconcile.reconcile_dead_worker(worker=name)
    ]
    for run in landed:
        try:
            recovery.recover(run_id=run.run_id)
        except Exception:  # noqa: BLE001 - the sweep tries again
            logger.exception("Run %s: could not be continued after its worker died", run.run_id)
    return len(landed)


class Supervisor:
    """`manage.py runworker`: starts `processes` worker processes (fork), restarts each that dies.

    It sees a child's death at once (`waitpid`), reconciles that child's runs conditional on their
    lease (so recovery continues them) and starts a replacement. SIGTERM (or SIGINT) is passed to
    every child, which drains; the parent waits for them.
    """

    def __init__(self, *, processes: int, capacity: int | None = None) -> None:
        self.processes = processes
        self.capacity = capacity
        self.children: dict[int, float] = {}
        self.stopping = False
        self.parent_pid = os.getpid()

    def _fork(self) -> int:
        # A child must not share the parent's database sockets.
        connections.close_all()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                serve_worker_process(parent_pid=self.parent_pid, capacity=self.capacity)
            except BaseException:  # noqa: BLE001 - the parent restarts it
                logger.exception("Worker process %s failed", os.getpid())
                code = 1
            finally:
                os._exit(code)
        self.children[pid] = time.monotonic()
        logger.info("Worker process %s started (%s)", pid, lifecycle.runworker_name(pid=pid))
        return pid

    def _request_stop(self, signum, frame) -> None:
        self.stopping = True

    def run(self) -> int:
        self.parent_pid = os.getpid()
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        for _ in range(self.processes):
            self._fork()
        signalled = False
        while self.children:
            if self.stopping and not signalled:
                signalled = True
                for pid in list(self.children):
                    _signal(pid, signal.SIGTERM)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(REAP_INTERVAL_SECONDS)
                continue
            started = self.children.pop(pid, None)
            if started is None:
                continue
            self._died(pid, status, lived=time.monotonic() - started)
        connections.close_all()
        return 0

    def _died(self, pid: int, status: int, *, lived: float) -> None:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"status {os.waitstatus_to_exitcode(status)}"
        try:
            count = after_worker_death(pid=pid)
        except Exception:  # noqa: BLE001 - the sweeps and staleness still catch them
            logger.exception("Worker process %s died; its runs could not be reconciled now", pid)
            count = 0
        finally:
            connections.close_all()
        if self.stopping:
            logger.info("Worker process %s ended (%s)", pid, how)
            return
        logger.warning("Worker process %s died (%s) with %d run(s): reconciled at once; starting another", pid, how, count)
        if lived < 1.0:
            # One that dies at start (a broken setting, the database down) is not restarted in a tight loop.
            time.sleep(1.0)
        if not self.stopping:
            self._fork()


# How often the parent looks for a dead child: its death is noticed within this.
REAP_INTERVAL_SECONDS = 0.1


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


# --- In this process, for a caller that waits (the test suite, a shell) ---------------------------


def run_queued(*, limit: int = 100) -> list[str]:
    """Claim what is queued (as a worker process would) and run each claimed run here, one after
    another; their statuses. For the test suite and a shell: a worker process runs them concurrently.
    """
    statuses: list[str] = []
    for run in lifecycle.claim_queued_runs(worker=lifecycle.worker_name(), limit=limit):
        control = executor.RunControl(run.run_id)
        executor.adopt(run, control)
        statuses.append(executor.run_adopted(run.run_id, control))
    return statuses
