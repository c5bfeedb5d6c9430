"""What goes over the wire: every statement a benchmark's connections send, counted and timed.

`Wire` collects the statements of SQLAlchemy engines (`trace_engine`, ADK's session store) and of
Django's connections (`trace_django`), on PostgreSQL read back from the server's own trace, so a
benchmark says how many statements and round trips a run costs beside its time.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field

WRITES = ("INSERT", "UPDATE", "DELETE")
# `WITH … INSERT` (the effect record's claim, say) writes as much as a bare INSERT does.
_WRITE_IN_WITH = re.compile(r"\b(INSERT|UPDATE|DELETE)\b", re.IGNORECASE)


def _writes(sql: str) -> bool:
    word = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else ""
    return word in WRITES or (word == "WITH" and _WRITE_IN_WITH.search(sql) is not None)


@dataclass
class _TraceReader:
    """Follows one connection's libpq trace: statements, round trips and commits since last read."""

    path: str
    offset: int = 0
    in_transaction: bool = False
    prepared: dict[str, str] = field(default_factory=dict)
    bound: str = ""
    # The open transaction set synchronous_commit off (agents.session_sql.commit_may_lag).
    lagging: bool = False

    def read(self, counts: dict[str, float]) -> None:
        with open(self.path, encoding="utf-8", errors="replace") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete.encode("utf-8", errors="replace"))
        # A statement's SQL may span lines: a line that starts no message continues the last one.
        lines: list[str] = []
        for line in complete.splitlines():
            if lines and not line.startswith(("F\t", "B\t")):
                lines[-1] += " " + line
            else:
                lines.append(line)
        for line in lines:
            self._line(line, counts)

    def _statement(self, sql: str, counts: dict[str, float]) -> None:
        counts["statements"] += 1
        if "'synchronous_commit', 'off'" in sql:
            self.lagging = True
        # A write outside BEGIN … COMMIT is a transaction of its own.
        if not self.in_transaction and _writes(sql):
            self._commit(counts)

    def _commit(self, counts: dict[str, float]) -> None:
        counts["commits"] += 1
        if self.lagging:
            counts["lagging_commits"] += 1
        self.lagging = False

    def _line(self, line: str, counts: dict[str, float]) -> None:
        parts = line.split("\t")
        if len(parts) < 3:
            return
        side, message, rest = parts[0], parts[2], parts[3] if len(parts) > 3 else ""
        if side == "B" and message == "ReadyForQuery":
            counts["round_trips"] += 1
            self.in_transaction = rest.strip() in ("T", "E")
        elif side == "F" and message == "Query":
            sql = rest.strip().strip('"')
            word = sql.split(None, 1)[0].upper() if sql else ""
            if word == "BEGIN":
                self.in_transaction = True
                self.lagging = False
            elif word == "COMMIT":
                self._commit(counts)
            elif word == "ROLLBACK":
                self.lagging = False
            else:
                self._statement(sql, counts)
        elif side == "F" and message == "Parse":
            name, _, sql = rest.strip().partition(" ")
            self.prepared[name.strip('"')] = sql.strip().strip('"')
        elif side == "F" and message == "Bind":
            names = rest.strip().split(" ")
            self.bound = self.prepared.get(names[1].strip('"'), "") if len(names) > 1 else ""
        elif side == "F" and message == "Execute":
            self._statement(self.bound or "SELECT", counts)


class Wire:
    """libpq's protocol trace on every new connection of a source (an engine, or Django)."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="bench-wire-")
        self.readers: list[_TraceReader] = []

    def trace(self, pgconn) -> None:
        import psycopg

        path = os.path.join(self.directory, f"{len(self.readers)}.trace")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        pgconn.trace(fd)
        pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE)
        self.readers.append(_TraceReader(path))

    def take(self) -> dict[str, float]:
        counts: dict[str, float] = defaultdict(float)
        for reader in self.readers:
            reader.read(counts)
        return counts


def trace_engine(engine, wire: Wire) -> None:
    """Trace `engine`'s connections from now on (its pool is emptied so that all are new)."""
    from sqlalchemy import event

    def on_connect(dbapi_connection, _record) -> None:
        wire.trace(dbapi_connection.driver_connection.pgconn)

    event.listen(engine.sync_engine, "connect", on_connect)


def trace_django(wire: Wire) -> None:
    """Trace every Django connection opened from now on (this thread's, the ORM thread's, beats')."""
    from asgiref.sync import SyncToAsync
    from django.db import connections
    from django.db.backends.signals import connection_created

    def on_created(sender, connection, **kwargs) -> None:
        wire.trace(connection.connection.pgconn)

    connection_created.connect(on_created, weak=False)
    connections.close_all()
    SyncToAsync.single_thread_executor.submit(connections.close_all).result()
