"""ADK's DatabaseSessionService with an event append that costs one short transaction.

Same tables, same rows, same classes and the same contract as the stock service (`adk web`
and any other ADK tool can share the database), but fewer statements on the paths a run takes:

- `append_event` is a compare-and-set: `UPDATE sessions … WHERE update_time = <the revision
  this copy was loaded at>`, instead of `SELECT … FOR UPDATE` and comparing in Python. The
  winner holds the row lock until its commit; a concurrent writer of the same revision then
  matches no row and gets `StaleSessionError`, exactly as with the locking read. App and user
  state rows are written only when the event carries a delta for them; the claim also requires
  both rows to exist, and an append that finds one missing raises the stock service's
  `ValueError` ("App state missing …") and writes nothing, instead of making the row again. On PostgreSQL the
  UPDATE and the event's INSERT are one statement (`WITH claimed AS (UPDATE … RETURNING)
  INSERT … SELECT … FROM claimed RETURNING`: no claimed row, no event row) and a COMMIT. On
  SQLite, which has no data-modifying CTE, they are two statements, and a session-state delta
  adds a third, because SQLite has no shallow JSON merge and the row is read back under the
  write lock instead.
- The event row is ADK's `StorageEvent`, built by `StorageEvent.from_event` and inserted with
  the mapping's own `before_insert`/`after_insert` hooks run on the same connection, exactly
  where a flush would run them: the tool journal (runs/ledger/journal.py) writes its rows in the
  event's transaction. The unit of work itself is skipped; it cost more than the rest of the
  append together.
- `get_session` reads the session with its app and user state in one statement and the events
  in a second, without opening a transaction on PostgreSQL (each statement sees committed data,
  as the stock service's READ COMMITTED transaction does, and the session row is read first so
  that a copy can only ever be older than its events, never newer).
- `create_session` inserts the session and reads both state rows in the same statement.
- Each operation runs in one greenlet on the engine's synchronous face, from statements built
  once, instead of paying SQLAlchemy's async bridge and statement construction per statement.
- No pre-ping per checkout. A connection that broke while idle in the pool fails its first
  statement with a disconnect error; SQLAlchemy then invalidates the pool, and the operation is
  retried once on a fresh connection. An append first checks whether its event row made it in
  (the commit may have reached the server before the connection dropped), so a retry never
  stores an event twice nor reports a stale session for its own write.

Anything the fast paths do not cover (the legacy v0 schema, dialects other than PostgreSQL and
SQLite, session copies without a revision marker) goes through the stock implementation.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from google.adk.errors._stale_session_error import StaleSessionError
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.errors.session_not_found_error import SessionNotFoundError
from google.adk.events.event import Event
from google.adk.platform import time as platform_time
from google.adk.platform import uuid as platform_uuid
from google.adk.sessions import _session_util
from google.adk.sessions.base_session_service import GetSessionConfig, ListSessionsResponse
from google.adk.sessions.database_session_service import (
    _STALE_SESSION_ERROR_MESSAGE,
    DatabaseSessionService,
    _merge_state,
)
from google.adk.sessions.migration import _schema_check_utils
from google.adk.sessions.schemas.shared import timestamp_to_utc_datetime, utc_datetime_to_timestamp
from google.adk.sessions.schemas.v1 import StorageEvent, StorageSession
from google.adk.sessions.session import Session
from sqlalchemy import Table, bindparam, inspect, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from agents.session_sql import (
    APP_STATE_EXISTS,
    APP_STATES,
    CLAIM_RETURNING_STATE,
    EVENT_COLUMNS,
    EVENT_EXISTS,
    EVENT_MAPPER,
    INSERT_EVENT,
    INSERT_SESSION,
    INSERT_SESSION_LAGGING,
    POSTGRESQL,
    READ_EVENTS,
    READ_EVENTS_AFTER,
    READ_SESSION,
    SESSION_EXISTS,
    SET_SESSION_STATE,
    SQLITE,
    TICK,
    USER_STATE_EXISTS,
    USER_STATES,
    Fenced,
    append_statement,
    commit_may_lag,
    fenced_for,
    riders,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

def _state_missing(session: Session, scope: str) -> ValueError:
    """What the stock service raises when an append finds no app or user state row, word for word."""
    if scope == "app":
        return ValueError(
            f"App state missing for app_name={session.app_name!r}. Session state tables should be "
            "initialized by create_session."
        )
    return ValueError(
        f"User state missing for app_name={session.app_name!r}, user_id={session.user_id!r}. "
        "Session state tables should be initialized by create_session."
    )


def _is_disconnect(exc: BaseException) -> bool:
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def _naive_utc(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(tzinfo=None) if moment.tzinfo else moment


def _key(session: Session) -> dict[str, str]:
    return {"k_app": session.app_name, "k_user": session.user_id, "k_session": session.id}


def _revision_after(current: datetime, event: Event) -> datetime:
    """The revision an append writes: the event's time, or one tick past the one it replaces.

    A compare-and-set on a value that can come back (an event timestamped at or before the
    current revision) would let a writer holding that older revision win: revisions only ever
    move forward here.
    """
    return max(timestamp_to_utc_datetime(event.timestamp), current + TICK)


def _insert_event_row(conn: Connection, row: StorageEvent, *, insert: Callable[[dict[str, Any]], bool]) -> bool:
    """Insert ADK's event row as a flush would, hooks included, on this connection.

    `insert` gets the row's column values and says whether the row went in; the after_insert
    hooks run only if it did.
    """
    state = inspect(row)
    EVENT_MAPPER.dispatch.before_insert(EVENT_MAPPER, conn, state)
    if not insert({column: getattr(row, attribute) for attribute, column in EVENT_COLUMNS}):
        return False
    EVENT_MAPPER.dispatch.after_insert(EVENT_MAPPER, conn, state)
    return True


class SessionStore(DatabaseSessionService):
    """A DatabaseSessionService whose writes are compare-and-set statements, not locking reads."""

    def __init__(
        self,
        db_url: str | None = None,
        db_engine: AsyncEngine | None = None,
        *,
        lagging_commits: bool = False,
        **kwargs: Any,
    ) -> None:
        # PostgreSQL: events without function calls commit with synchronous_commit off (commit_may_lag).
        self._lagging_commits = lagging_commits
        if db_url is not None:
            # The stock service pings every checkout; this one recovers from a dead connection.
            kwargs.setdefault("pool_pre_ping", False)
        super().__init__(db_url=db_url, db_engine=db_engine, **kwargs)
        self._dialect = self.db_engine.dialect.name
        # Reads need no transaction: BEGIN and the ROLLBACK at check-in are two round trips on
        # PostgreSQL. pysqlite opens no transaction for a SELECT anyway.
        self._read_engine = (
            self.db_engine.execution_options(isolation_level="AUTOCOMMIT")
            if self._dialect == POSTGRESQL
            else self.db_engine
        )

    # --- Plumbing ---------------------------------------------------------------------------------

    def _fast(self) -> bool:
        return (
            self._dialect in (POSTGRESQL, SQLITE)
            and self._db_schema_version == _schema_check_utils.LATEST_SCHEMA_VERSION
        )

    async def _in_one_greenlet(self, work: Callable[[Connection], T], *, read: bool = False) -> T:
        # What AsyncConnection.run_sync does, minus the two extra greenlets for connect and close.
        engine = (self._read_engine if read else self.db_engine).sync_engine

        def checked_out() -> T:
            with engine.connect() as conn:
                return work(conn)

        return await greenlet_spawn(checked_out)

    @property
    def dialect(self) -> str:
        """The database the store writes to ("postgresql", "sqlite", …)."""
        return self._dialect

    async def on_own_connection(self, work: Callable[[Connection], T], *, autocommit: bool = False) -> T:
        """Run `work` on one of the store's own connections, on the running loop: no hop to a
        thread, and statements psycopg prepares after their first few runs on that connection.

        `autocommit`: each statement commits by itself (one round trip for a one-statement
        write); otherwise `work` opens its own transaction (`conn.begin()`). For writes that
        belong beside the events, such as the ledger's effect records.
        """
        if not autocommit:
            return await self._in_one_greenlet(work)

        def autocommitted(conn: Connection) -> T:
            return work(conn.execution_options(isolation_level="AUTOCOMMIT"))

        return await self._in_one_greenlet(autocommitted)

    async def _once_more_on_disconnect(self, operation: Callable[[], Awaitable[T]], *, what: str) -> T:
        """Run an idempotent `operation`, again on a fresh connection if the first one was dead."""
        try:
            return await operation()
        except DBAPIError as exc:
            if not _is_disconnect(exc):
                raise
            # SQLAlchemy has invalidated the pool: the next checkout opens a fresh connection.
            logger.warning("ADK session store: connection lost during %s (%s); retrying once", what, exc.orig)
        return await operation()

    # --- Appending --------------------------------------------------------------------------------

    async def append_event(self, session: Session, event: Event) -> Event:
        await self.prepare_tables()
        if event.partial:
            return event
        if not self._fast() or session._storage_update_marker is None:
            # A copy without a marker (built by hand, or by an older service) needs the stock
            # service's comparison against the stored events.
            return await super().append_event(session, event)

        self._apply_temp_state(session, event)
        event = self._trim_temp_delta_state(event)
        deltas = _session_util.extract_json_safe_state_delta(event.actions.state_delta or {})

        async with self._with_session_lock(app_name=session.app_name, user_id=session.user_id, session_id=session.id):
            # Read under the lock: the previous append of this process may just have moved it.
            expected = _naive_utc(datetime.fromisoformat(session._storage_update_marker))
            revision = _revision_after(expected, event)
            row = StorageEvent.from_event(session, event)

            def append(conn: Connection) -> None:
                self._append(
                    conn, session=session, event=event, row=row, deltas=deltas, expected=expected, revision=revision
                )

            try:
                await self._in_one_greenlet(append)
            except DBAPIError as exc:
                if not _is_disconnect(exc):
                    raise
                logger.warning("ADK session store: connection lost during append_event (%s); retrying once", exc.orig)
                # The COMMIT may have reached the server before the connection dropped: then the
                # event is stored and a second attempt would only find its own revision "stale".
                if not await self._in_one_greenlet(lambda conn: self._event_stored(conn, session, event), read=True):
                    await self._in_one_greenlet(append)
            session.last_update_time = utc_datetime_to_timestamp(revision)
            session._storage_update_marker = revision.isoformat(timespec="microseconds")

        return self._commit_event_to_session(session, event)

    def _append(
        self,
        conn: Connection,
        *,
        session: Session,
        event: Event,
        row: StorageEvent,
        deltas: dict[str, dict[str, Any]],
        expected: datetime,
        revision: datetime,
    ) -> None:
        key = _key(session)
        claim = {**key, "k_expected": expected, "k_revision": revision}
        session_delta = deltas["session"]
        fenced = fenced_for(self._dialect)
        fence_params = fenced.fence.params(event) if fenced is not None else None
        if fence_params is None:
            fenced = None
        else:
            claim.update(fence_params)
        with conn.begin():
            if self._dialect == POSTGRESQL:
                if session_delta:
                    claim["k_delta"] = session_delta
                lagging = self._lagging_commits and commit_may_lag(event)

                def claim_and_insert(values: dict[str, Any]) -> bool:
                    params = {**claim, **{f"e_{column}": value for column, value in values.items()}}
                    # Asked after the before_insert hooks, on the row as it will be stored.
                    ride = riders[0].params(row) if riders else None
                    if ride is not None:
                        params.update(ride)
                    statement = append_statement(
                        fenced, merge=bool(session_delta), ride=ride is not None, lagging=lagging
                    )
                    return conn.execute(statement, params).first() is not None

                if not _insert_event_row(conn, row, insert=claim_and_insert):
                    self._raise_lost_race(conn, session, event=event, fenced=fenced, claim=claim)
            else:
                claim_statement = fenced.claim_returning_state if fenced is not None else CLAIM_RETURNING_STATE
                stored = conn.execute(claim_statement, claim).first()
                if stored is None:
                    self._raise_lost_race(conn, session, event=event, fenced=fenced, claim=claim)
                # The UPDATE above took SQLite's write lock: nobody can change the state in between.
                if session_delta:
                    conn.execute(SET_SESSION_STATE, {**key, "k_state": {**(stored.state or {}), **session_delta}})

                def insert(values: dict[str, Any]) -> bool:
                    conn.execute(INSERT_EVENT, values)
                    return True

                _insert_event_row(conn, row, insert=insert)
            # The claim saw both state rows; one deleted since is refused as the stock service
            # would, never made again.
            if deltas["app"]:
                app_keys = {"app_name": session.app_name}
                if self._merge_state_row(conn, APP_STATES, app_keys, deltas["app"], revision, create=False) is None:
                    raise _state_missing(session, "app")
            if deltas["user"]:
                keys = {"app_name": session.app_name, "user_id": session.user_id}
                if self._merge_state_row(conn, USER_STATES, keys, deltas["user"], revision, create=False) is None:
                    raise _state_missing(session, "user")

    @staticmethod
    def _raise_lost_race(
        conn: Connection,
        session: Session,
        *,
        event: Event | None = None,
        fenced: Fenced | None = None,
        claim: dict[str, Any] | None = None,
    ) -> None:
        # Only a lost compare-and-set pays for these reads: was the event fenced off, the session
        # advanced, or is it gone?
        if fenced is not None and event is not None and conn.execute(fenced.holds, claim).first() is None:
            raise fenced.fence.refused(event)
        if not conn.execute(SESSION_EXISTS, _key(session)).scalar():
            raise SessionNotFoundError(f"Session {session.id} not found.")
        if not conn.execute(APP_STATE_EXISTS, _key(session)).scalar():
            raise _state_missing(session, "app")
        if not conn.execute(USER_STATE_EXISTS, _key(session)).scalar():
            raise _state_missing(session, "user")
        raise StaleSessionError(_STALE_SESSION_ERROR_MESSAGE)

    @staticmethod
    def _event_stored(conn: Connection, session: Session, event: Event) -> bool:
        return bool(conn.execute(EVENT_EXISTS, {**_key(session), "k_event": event.id}).scalar())

    def _merge_state_row(
        self,
        conn: Connection,
        table: Table,
        keys: dict[str, str],
        delta: dict[str, Any],
        when: datetime,
        *,
        create: bool = True,
    ) -> dict[str, Any] | None:
        """Merge `delta` into an app or user state row; the merged state.

        A missing row is created (`create`, as creating a session does) or left missing: None.
        """
        this_row = [table.c[name] == value for name, value in keys.items()]
        if self._dialect == POSTGRESQL:
            if create:
                statement = postgresql.insert(table).values(**keys, state=delta, update_time=when)
                statement = statement.on_conflict_do_update(
                    index_elements=list(keys),
                    set_={
                        "state": table.c.state.op("||")(statement.excluded.state),
                        "update_time": statement.excluded.update_time,
                    },
                ).returning(table.c.state)
            else:
                merged_state = table.c.state.op("||")(bindparam("k_state_delta", delta, type_=postgresql.JSONB))
                statement = (
                    update(table).where(*this_row).values(state=merged_state, update_time=when).returning(table.c.state)
                )
            stored = conn.execute(statement).first()
            return None if stored is None else dict(stored.state)
        if create:
            statement = sqlite.insert(table).values(**keys, state=delta, update_time=when)
            statement = statement.on_conflict_do_update(
                index_elements=list(keys), set_={"update_time": statement.excluded.update_time}
            ).returning(table.c.state)
        else:
            statement = update(table).where(*this_row).values(update_time=when).returning(table.c.state)
        stored = conn.execute(statement).first()
        if stored is None:
            return None
        current = dict(stored.state or {})
        merged = {**current, **delta}
        if merged != current:
            conn.execute(update(table).where(*this_row).values(state=merged))
        return merged

    # --- Creating ---------------------------------------------------------------------------------

    async def create_session(
        self,
        *,
        app_name: str,
        user_id: str,
        state: dict[str, Any] | None = None,
        session_id: str | None = None,
    ) -> Session:
        await self.prepare_tables()
        if not self._fast():
            return await super().create_session(app_name=app_name, user_id=user_id, state=state, session_id=session_id)
        session_id = session_id if session_id is not None else platform_uuid.new_uuid()
        deltas = _session_util.extract_json_safe_state_delta(state or {})
        now = datetime.fromtimestamp(platform_time.get_time(), tz=UTC).replace(tzinfo=None)

        def create(conn: Connection) -> Session:
            return self._create(conn, app_name=app_name, user_id=user_id, session_id=session_id, deltas=deltas, now=now)

        return await self._once_more_on_disconnect(lambda: self._in_one_greenlet(create), what="create_session")

    def _create(
        self,
        conn: Connection,
        *,
        app_name: str,
        user_id: str,
        session_id: str,
        deltas: dict[str, dict[str, Any]],
        now: datetime,
    ) -> Session:
        app_keys = {"app_name": app_name}
        user_keys = {"app_name": app_name, "user_id": user_id}
        with conn.begin():
            app_state = user_state = None
            if deltas["app"]:
                app_state = self._merge_state_row(conn, APP_STATES, app_keys, deltas["app"], now)
            if deltas["user"]:
                user_state = self._merge_state_row(conn, USER_STATES, user_keys, deltas["user"], now)
            values = {"k_app": app_name, "k_user": user_id, "k_session": session_id, "k_state": deltas["session"]}
            insert = INSERT_SESSION_LAGGING if self._lagging_commits and self._dialect == POSTGRESQL else INSERT_SESSION
            try:
                inserted = conn.execute(insert, {**values, "k_now": now}).one()
            except IntegrityError:
                raise AlreadyExistsError(f"Session with id {session_id} already exists.") from None
            if app_state is None:
                app_state = inserted.app_state
                if app_state is None:
                    app_state = self._ensure_state_row(conn, APP_STATES, app_keys, now)
            if user_state is None:
                user_state = inserted.user_state
                if user_state is None:
                    user_state = self._ensure_state_row(conn, USER_STATES, user_keys, now)
        storage_session = StorageSession(app_name=app_name, user_id=user_id, id=session_id, update_time=now)
        return storage_session.to_session(state=_merge_state(app_state, user_state, deltas["session"]))

    def _ensure_state_row(self, conn: Connection, table: Table, keys: dict[str, str], when: datetime) -> dict[str, Any]:
        """Create an empty app or user state row; if a concurrent creator won, its state."""
        dialect_insert = postgresql.insert if self._dialect == POSTGRESQL else sqlite.insert
        statement = dialect_insert(table).values(**keys, state={}, update_time=when).on_conflict_do_nothing()
        # RETURNING, not the row count: an INSERT's row count is not reliable across drivers.
        if conn.execute(statement.returning(table.c.state)).first() is not None:
            return {}
        existing = select(table.c.state).where(*(table.c[name] == value for name, value in keys.items()))
        return dict(conn.execute(existing).scalar_one() or {})

    # --- Reading ----------------------------------------------------------------------------------

    async def get_session(
        self,
        *,
        app_name: str,
        user_id: str,
        session_id: str,
        config: GetSessionConfig | None = None,
    ) -> Session | None:
        await self.prepare_tables()
        if not self._fast():
            return await super().get_session(app_name=app_name, user_id=user_id, session_id=session_id, config=config)
        key = {"k_app": app_name, "k_user": user_id, "k_session": session_id}

        def read(conn: Connection) -> tuple[Row | None, list[Row]]:
            return self._read(conn, key=key, config=config)

        found, event_rows = await self._once_more_on_disconnect(
            lambda: self._in_one_greenlet(read, read=True), what="get_session"
        )
        if found is None:
            return None
        storage_session = StorageSession(
            app_name=app_name, user_id=user_id, id=session_id, update_time=found.update_time
        )
        return storage_session.to_session(
            state=_merge_state(found.app_state or {}, found.user_state or {}, found.state or {}),
            events=[
                StorageEvent(
                    id=e.id, invocation_id=e.invocation_id, timestamp=e.timestamp, event_data=e.event_data
                ).to_event()
                for e in reversed(event_rows)
            ],
        )

    @staticmethod
    def _read(
        conn: Connection, *, key: dict[str, str], config: GetSessionConfig | None
    ) -> tuple[Row | None, list[Row]]:
        # The session row first: its revision can then only be older than the events read next,
        # so a racing append makes the next write stale instead of silently skipping an event
        # this copy never saw.
        found = conn.execute(READ_SESSION, key).first()
        if found is None or (config and config.num_recent_events == 0):
            return found, []
        events, params = READ_EVENTS, dict(key)
        if config and config.after_timestamp:
            events = READ_EVENTS_AFTER
            params["k_after"] = datetime.fromtimestamp(config.after_timestamp, tz=UTC).replace(tzinfo=None)
        if config and config.num_recent_events is not None:
            events = events.limit(config.num_recent_events)
        return found, list(conn.execute(events, params).all())

    async def list_sessions(self, *, app_name: str, user_id: str | None = None) -> ListSessionsResponse:
        async def read() -> ListSessionsResponse:
            return await super(SessionStore, self).list_sessions(app_name=app_name, user_id=user_id)

        return await self._once_more_on_disconnect(read, what="list_sessions")

    async def get_user_state(self, *, app_name: str, user_id: str) -> dict[str, Any]:
        async def read() -> dict[str, Any]:
            return await super(SessionStore, self).get_user_state(app_name=app_name, user_id=user_id)

        return await self._once_more_on_disconnect(read, what="get_user_state")

    async def delete_session(self, app_name: str, user_id: str, session_id: str) -> None:
        # Deleting twice deletes nothing more: safe to repeat whether or not the commit landed.
        async def delete() -> None:
            await super(SessionStore, self).delete_session(app_name=app_name, user_id=user_id, session_id=session_id)

        await self._once_more_on_disconnect(delete, what="delete_session")
