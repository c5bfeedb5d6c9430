"""Waking workers: a write that makes work claimable says so, and each worker process listens.

The run table (and the webhook inbox) is the queue: a `queued` row is claimable whether or not
anyone was told. Telling only shortens the wait. On PostgreSQL the write's own transaction runs
`pg_notify` (delivered at its commit, dropped with its rollback, and several in one transaction
folded into one); each worker process LISTENs on one dedicated connection (`Listener`) and also
polls every RUN_POLL_SECONDS, so a lost notification delays a run by one poll at most, never
loses it. SQLite has no notifications: its workers poll.

The listener connection also carries the process's session-level advisory lock (`runs.ledger.presence`):
the lock lives exactly as long as the connection, so another process can tell at once that this
one is gone.
"""

from __future__ import annotations

import logging
import select
import time
from typing import Any

from django.conf import settings
from django.db import connections

logger = logging.getLogger(__name__)

RUNS_CHANNEL = "agentledger_runs"
INBOX_CHANNEL = "agentledger_inbox"
CHANNELS = (RUNS_CHANNEL, INBOX_CHANNEL)


def notify(channel: str, *, using: str = "default") -> None:
    """Tell the workers that `channel` has claimable work, at the commit of the current transaction."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, '')", [channel])


def listener_connection_params(using: str = "default") -> dict[str, Any]:
    """The ORM's connection parameters for a plain psycopg connection (the listener's)."""
    params = dict(connections[using].get_connection_params())
    # Django's own cursor class and adapters are the ORM's business; the listener sends two statements.
    for key in ("cursor_factory", "context"):
        params.pop(key, None)
    return params


class Listener:
    """One dedicated autocommit connection per worker process: LISTEN, and the process's advisory lock.

    `wait(seconds)` returns the channels notified (possibly none) after at most `seconds`; a
    broken connection is reopened on the next wait (its notifications meanwhile are covered by
    the poll, and its lock is taken again).
    """

    def __init__(self, *, using: str = "default", on_connect: Any = None) -> None:
        self.using = using
        self.on_connect = on_connect
        self.connection: Any = None
        self.enabled = connections[using].vendor == "postgresql" and settings.RUN_LISTEN

    def connect(self) -> None:
        if not self.enabled or self.connection is not None:
            return
        import psycopg

        connection = psycopg.connect(**listener_connection_params(self.using), autocommit=True)
        for channel in CHANNELS:
            connection.execute(f"LISTEN {channel}")
        self.connection = connection
        if self.on_connect is not None:
            self.on_connect(connection)

    def close(self) -> None:
        if self.connection is not None:
            try:
                self.connection.close()
            finally:
                self.connection = None

    def wait(self, seconds: float) -> set[str]:
        if not self.enabled:
            time.sleep(seconds)
            return set()
        try:
            self.connect()
            return self._wait(seconds)
        except Exception:  # noqa: BLE001 - the poll covers what a broken listener misses
            logger.warning("The worker's listener connection failed; polling until it is back", exc_info=True)
            self.close()
            time.sleep(min(seconds, 1.0))
            return set(CHANNELS)

    def _wait(self, seconds: float) -> set[str]:
        channels = self._drain()
        if channels:
            return channels
        readable, _, _ = select.select([self.connection.fileno()], [], [], seconds)
        if readable:
            return self._drain() or set()
        return set()

    def _drain(self) -> set[str]:
        # Reading with a zero timeout consumes what the socket holds without blocking.
        return {notify.channel for notify in self.connection.notifies(timeout=0, stop_after=None)}
