"""One heartbeat per process, for every run the process holds.

A plain thread (not the agent loop, so a tool that blocks the loop cannot make live runs look
dead) refreshes `heartbeat_at` of all of the process's runs in one statement and reads their
cancel requests in one query, then turns each cancel request, and each run past
RUN_TIMEOUT_SECONDS, into that run's ADK abort signal. A run the process no longer holds (its
lease is gone: reconciled while this process was paused, say) is aborted the same way, and so is
a run one of whose writes was just refused (`runs.ledger.leases`). Because a process's runs share one beat,
they go stale together when the process dies, and one reconcile sweep finds them all.

The thread exists only while the process holds a run: it exits (closing its database
connection) when the last run leaves and is started again by the next one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Protocol

from django.conf import settings
from django.db import close_old_connections, connection

from runs.ledger import leases, lifecycle
from runs.ledger.counters import LEASE_REFUSALS

logger = logging.getLogger(__name__)


class Beating(Protocol):
    """What the heartbeat needs of a run in flight (`runs.execution.executor.RunControl`)."""

    run_id: uuid.UUID
    lease: uuid.UUID | None
    started_monotonic: float
    cancelled_by_request: bool

    def abort(self, reason: str) -> None: ...


class ProcessHeartbeat:
    def __init__(self) -> None:
        self._runs: dict[uuid.UUID, Beating] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, control: Beating) -> None:
        with self._lock:
            self._runs[control.run_id] = control
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="run-heartbeat", daemon=True)
                self._thread.start()

    def remove(self, control: Beating) -> None:
        with self._lock:
            if self._runs.get(control.run_id) is control:
                del self._runs[control.run_id]

    def lose(self, run_id: uuid.UUID) -> None:
        """A write for the run was refused (its lease is gone): abort it here at once."""
        with self._lock:
            control = self._runs.get(run_id)
        if control is not None:
            control.abort(leases.LEASE_LOST)

    def run_ids(self) -> list[uuid.UUID]:
        with self._lock:
            return list(self._runs)

    def _run(self) -> None:
        try:
            while True:
                time.sleep(settings.RUN_HEARTBEAT_SECONDS)
                with self._lock:
                    controls = list(self._runs.values())
                    if not controls:
                        # Decided under the lock, so a run added now starts a new thread.
                        self._thread = None
                        return
                self.beat_once(controls)
        finally:
            connection.close()

    @staticmethod
    def beat_once(controls: list[Beating]) -> None:
        try:
            beat = lifecycle.beat_many(held={control.run_id: control.lease for control in controls})
        except Exception:
            # A database hiccup must not kill the runs; the next beat tries again.
            logger.exception("Heartbeat of %d run(s) failed", len(controls))
            close_old_connections()
            return
        now = time.monotonic()
        for control in controls:
            if control.run_id in beat.lost:
                # Reconciled or settled elsewhere while this process still ran it: stop before
                # it writes anything more (its next write would be refused anyway).
                LEASE_REFUSALS.labels(write="heartbeat").inc()
                logger.warning("Run %s is no longer held by this worker (its lease is gone); aborting it",
                               control.run_id)
                control.abort(leases.LEASE_LOST)
            elif control.run_id in beat.cancel_requested:
                control.cancelled_by_request = True
                control.abort("cancel_requested")
            elif now - control.started_monotonic > settings.RUN_TIMEOUT_SECONDS:
                control.abort("timeout")


_state: dict[str, object] = {"pid": None, "heartbeat": None}
_state_lock = threading.Lock()


def process_heartbeat() -> ProcessHeartbeat:
    """This process's heartbeat (a forked child gets its own: the parent's thread is not there)."""
    with _state_lock:
        if _state["pid"] != os.getpid():
            _state.update(pid=os.getpid(), heartbeat=ProcessHeartbeat())
        return _state["heartbeat"]  # type: ignore[return-value]


leases.abort_refused_runs_with(lambda run_id: process_heartbeat().lose(run_id))
