"""The cluster's bounded task queue gets back the slots its dead readers and writers took.

Real forked processes die at the exact point that loses a slot (a reader that read a task, still
holding the reader lock, before it gave the slot back), so no cluster and no database is needed:
what `runs.deaths` does in the sentinel after such a death is called here directly.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as std_queue

import pytest
from django_q import queues

from runs import queue_locks
from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="the cluster's queues are tracked on fork only"
)


@pytest.fixture
def bounded_queue(monkeypatch):
    monkeypatch.setattr(queues.Queue, "__init__", queue_locks._init)
    made = []

    def make(limit: int) -> queues.Queue:
        made.append(queues.Queue(maxsize=limit))
        return made[-1]

    yield make
    for queue in made:
        queue.cancel_join_thread()
        queue.close()


def _die_after_reading(queue: queues.Queue) -> None:
    # Queue.get() up to its last step: the task read, the reader lock held, the slot not given back.
    queue._rlock.acquire()
    queue._recv_bytes()
    os._exit(0)


def _kill_a_reader_after_its_read(queue: queues.Queue) -> int:
    reader = multiprocessing.get_context("fork").Process(target=_die_after_reading, args=(queue,))
    reader.start()
    reader.join(timeout=30)
    assert reader.exitcode == 0
    return reader.pid


def _in_pipe(queue: queues.Queue) -> int:
    return queue_locks._bytes_waiting(queue)


def test_slots_lost_with_readers_killed_after_their_read_are_given_back(bounded_queue):
    queue = bounded_queue(2)
    queue.put("first")
    queue.put("second")
    wait_until(lambda: _in_pipe(queue), what="the tasks to be written")
    for _ in range(2):
        pid = _kill_a_reader_after_its_read(queue)
        # What the sentinel does first when it replaces the dead process (runs.deaths).
        assert queue_locks.release_locks_of_dead(pid, {"task": queue}) == ["the task queue's reader lock"]
    assert _in_pipe(queue) == 0
    # Both slots are gone with their readers: the pusher would now wait forever on an empty queue.
    with pytest.raises(std_queue.Full):
        queue.put("third", timeout=0.5)

    watch = queue_locks.SlotWatch(queue, patience=3)
    given = [watch.check() for _ in range(6)]
    # One slot back after `patience` looks in a row, never more than were lost.
    assert given == [False, False, True, False, False, True]
    assert watch.taken() == 0 and not watch.check()

    queue.put("third", timeout=5)
    queue.put("fourth", timeout=5)
    # Whole tasks, in order: nothing was left half read.
    assert [queue.get(timeout=5), queue.get(timeout=5)] == ["third", "fourth"]


def test_a_slot_whose_task_waits_in_the_pipe_is_left_alone(bounded_queue):
    queue = bounded_queue(1)
    queue.put("waiting")
    wait_until(lambda: _in_pipe(queue), what="the task to be written")
    watch = queue_locks.SlotWatch(queue, patience=2)
    assert not any(watch.check() for _ in range(6))
    assert watch.taken() == 1
    with pytest.raises(std_queue.Full):
        queue.put("more", timeout=0.2)
    assert queue.get(timeout=5) == "waiting"
