"""The cluster's own queues survive a SIGKILLed process (django-q2's wedge, and its work-around).

A django-q2 cluster moves tasks from its pusher to its workers, and results from its workers to
its monitor, through two `multiprocessing` queues. Each queue has a reader lock, held by the one
process blocked waiting for the next message (an idle worker spends its life there, the monitor
too), and a writer lock, held while a message is written to the pipe (the pusher's feeder thread
for tasks, a worker's for results). These are plain semaphores: a process SIGKILLed while it
holds one never releases it, and every other reader (or writer) waits forever. Measured here: one
SIGKILL of the idle worker that waits on the task queue, and no run is started by that cluster
again (the tasks stay in the pipe; runs stay `queued`, however often they are enqueued again).

So each lock of those queues remembers which process holds it (a shared integer, written right
after the lock is taken and cleared right before it is released), and the sentinel, which starts
every process of the cluster and sees each one die (`runs.deaths`), releases the locks a dead
process still held before it starts its replacement. The lock was held while the process waited,
so nothing was half read: the next reader gets the next whole message.

The task queue is bounded (Q_CLUSTER queue_limit, one task per worker) by a semaphore that a
writer takes before it writes and the READER gives back after it read. A worker killed between
reading a task and giving back its slot, or a pusher killed between taking a slot and writing its
task, loses that slot for good; after queue_limit such losses (two, with two workers: a few quick
kills in a row) the pusher waits forever for room in an empty queue and the cluster is silent.
Nothing records which process holds a slot, so the sentinel watches the queue instead
(`SlotWatch`): slots taken while the pipe holds no byte, seen so on several checks a second apart,
belong to nobody (a slot in transit is so for microseconds), and it gives them back one by one.
The task a dead worker had read is still leased in the broker and started again by the requeue
rule (`runs.reconcile`).

What is left: a process killed within the few instructions between taking (or releasing) a lock
and writing down that it holds it, or in the middle of reading one message's two parts, is not
repaired.
"""

from __future__ import annotations

import array
import fcntl
import logging
import multiprocessing
import os
import termios
import threading
from multiprocessing.synchronize import SEM_VALUE_MAX
from typing import Any

from django_q import queues

logger = logging.getLogger(__name__)


class TrackedLock:
    """A multiprocessing lock that remembers the process holding it, so its death can release it."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        # Created before the cluster forks its processes, so each of them shares it.
        self.holder = multiprocessing.RawValue("i", 0)

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        got = self._lock.acquire(block, timeout)
        if got:
            self.holder.value = os.getpid()
        return got

    def release(self) -> None:
        self.holder.value = 0
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release_for_dead(self, pid: int) -> bool:
        """Release the lock if the dead process `pid` held it; whether it did."""
        if not pid or self.holder.value != pid:
            return False
        self.holder.value = 0
        try:
            self._lock.release()
        except ValueError:  # it was released after all (killed between the two steps)
            return False
        return True


def release_locks_of_dead(pid: int, named_queues: dict[str, Any]) -> list[str]:
    """Release every lock of `named_queues` the dead process `pid` held; which ones it released."""
    released = []
    for queue_name, queue in named_queues.items():
        for attribute, what in (("_rlock", "reader"), ("_wlock", "writer")):
            lock = getattr(queue, attribute, None)
            if isinstance(lock, TrackedLock) and lock.release_for_dead(pid):
                released.append(f"the {queue_name} queue's {what} lock")
    return released


def _bytes_waiting(queue: Any) -> int:
    waiting = array.array("i", [0])
    fcntl.ioctl(queue._reader.fileno(), termios.FIONREAD, waiting)
    return waiting[0]


class SlotWatch:
    """Gives back the slots of a bounded queue that no process holds any more (see the module)."""

    def __init__(self, queue: Any, *, patience: int = 3) -> None:
        self.queue = queue
        self.patience = patience
        self._seen = 0

    def taken(self) -> int:
        return self.queue._maxsize - self.queue._sem._semlock._get_value()

    def check(self) -> bool:
        """One look at the queue; whether it gave a slot back."""
        if not self.taken() or _bytes_waiting(self.queue):
            self._seen = 0
            return False
        self._seen += 1
        if self._seen < self.patience:
            return False
        self._seen = 0
        try:
            self.queue._sem.release()
        except ValueError:  # every slot came back meanwhile
            return False
        return True


def _watch(queue: Any, stop_event: Any, every: float) -> None:
    watch = SlotWatch(queue)
    while not stop_event.wait(every):
        try:
            if watch.check():
                logger.warning("The task queue had a slot no process held (its holder died): given back")
        except (OSError, ValueError):  # the queue is closed: the cluster stops
            return


def watch_task_slots(queue: Any, stop_event: Any, *, every: float = 1.0) -> threading.Thread | None:
    """Watch a bounded queue for lost slots on a daemon thread of this process (the sentinel)."""
    if queue._maxsize >= SEM_VALUE_MAX:
        return None  # unbounded: no slot can be missed
    thread = threading.Thread(target=_watch, args=(queue, stop_event, every), name="task-slots", daemon=True)
    thread.start()
    return thread


_original_init = queues.Queue.__init__


def _init(self: queues.Queue, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    self._rlock = TrackedLock(self._rlock)
    if self._wlock is not None:
        self._wlock = TrackedLock(self._wlock)


def track_queue_locks() -> None:
    """Make django-q2's cluster queues remember their lock holders (forked processes only).

    A queue handed to a spawned process would be pickled with its locks; django-q2 forks where it
    can, and elsewhere the queues stay as they are.
    """
    if "fork" not in multiprocessing.get_all_start_methods():
        return
    queues.Queue.__init__ = _init
