"""ADK's DatabaseSessionService with an event append that costs one short transaction.

Same tables, same rows, same classes and the same contract as the stock service (`adk web`
and any other ADK tool can share the database), but fewer statements on the paths a run takes:

- `append_event` is a compare-and-set: `UPDATE sessions … WHERE update_time = <the revision
  this copy was loaded at>` and a row count, instead of `SELECT … FOR UPDATE` and comparing in
  Python. The winner holds the row lock until its commit; a concurrent writer of the same
  revision then matches no row and gets `StaleSessionError`, exactly as with the locking read.
  App and user state rows are written only when the event carries a delta for them. The event
  row is still inserted through ADK's `StorageEvent` mapping, so mapper hooks (the tool
  journal, see runs/journal.py) write in the same transaction. On PostgreSQL that is
  UPDATE + INSERT + COMMIT; on SQLite a session-state delta adds one statement, because
  SQLite has no shallow JSON merge and the row is read back under the write lock instead.
- `get_session` reads the session with its app and user state in one statement and the events
  in a second, without opening a transaction on PostgreSQL (each statement sees committed data,
  as the stock service's READ COMMITTED transaction does, and the session row is read first so
  that a copy can only ever be older than its events, never newer).
- `create_session` inserts the session and reads both state rows in the same statement.
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
from datetime import UTC, datetime, timedelta
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
from google.adk.sessions.schemas.v1 import StorageAppState, StorageEvent, StorageSession, StorageUserState
from google.adk.sessions.session import Session
from sqlalchemy import Table, and_, bindparam, exists, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SESSIONS: Table = StorageSession.__table__
_EVENTS: Table = StorageEvent.__table__
_APP_STATES: Table = StorageAppState.__table__
_USER_STATES: Table = StorageUserState.__table__

_POSTGRESQL = "postgresql"
_SQLITE = "sqlite"
# One microsecond is the resolution of the revision column on both databases.
_TICK = timedelta(microseconds=1)


def _is_disconnect(exc: BaseException) -> bool:
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def _naive_utc(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(tzinfo=None) if moment.tzinfo else moment


class SessionStore(DatabaseSessionService):
    """A DatabaseSessionService whose writes are compare-and-set statements, not locking reads."""

    def __init__(self, db_url: str | None = None, db_engine: AsyncEngine | None = None, **kwargs: Any) -> None:
        if db_url is not None:
            # The stock service pings every checkout; this one recovers from a dead connection.
            kwargs.setdefault("pool_pre_ping", False)
        super().__init__(db_url=db_url, db_engine=db_engine, **kwargs)
        dialect = self.db_engine.dialect.name
        self._dialect = dialect
        # Reads need no transaction: BEGIN and the ROLLBACK at check-in are two round trips on
        # PostgreSQL. pysqlite opens no transaction for a SELECT anyway.
        self._read_engine = (
            self.db_engine.execution_options(isolation_level="AUTOCOMMIT") if dialect == _POSTGRESQL else self.db_engine
        )

    # --- Plumbing ---------------------------------------------------------------------------------

    def _fast(self) -> bool:
        return (
            self._dialect in (_POSTGRESQL, _SQLITE)
            and self._db_schema_version == _schema_check_utils.LATEST_SCHEMA_VERSION
        )

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

    @staticmethod
    def _revision_after(current: datetime, event: Event) -> datetime:
        """The revision an append writes: the event's time, or one tick past the one it replaces.

        A compare-and-set on a value that can come back (an event timestamped at or before the
        current revision) would let a writer holding that older revision win: revisions only
        ever move forward here.
        """
        return max(timestamp_to_utc_datetime(event.timestamp), current + _TICK)

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
            revision = self._revision_after(expected, event)

            append = {"session": session, "event": event, "deltas": deltas, "expected": expected, "revision": revision}
            try:
                await self._append_once(**append)
            except DBAPIError as exc:
                if not _is_disconnect(exc):
                    raise
                logger.warning("ADK session store: connection lost during append_event (%s); retrying once", exc.orig)
                # The COMMIT may have reached the server before the connection dropped: then the
                # event is stored and a second attempt would only find its own revision "stale".
                if not await self._event_stored(session=session, event=event):
                    await self._append_once(**append)
            session.last_update_time = utc_datetime_to_timestamp(revision)
            session._storage_update_marker = revision.isoformat(timespec="microseconds")

        return self._commit_event_to_session(session, event)

    async def _append_once(
        self,
        *,
        session: Session,
        event: Event,
        deltas: dict[str, dict[str, Any]],
        expected: datetime,
        revision: datetime,
    ) -> None:
        key = and_(
            _SESSIONS.c.app_name == session.app_name,
            _SESSIONS.c.user_id == session.user_id,
            _SESSIONS.c.id == session.id,
        )
        async with self._rollback_on_exception_session() as sql:
            claim = update(_SESSIONS).where(key, _SESSIONS.c.update_time == expected).values(update_time=revision)
            session_delta = deltas["session"]
            if self._dialect == _POSTGRESQL:
                if session_delta:
                    # jsonb || is a shallow merge, exactly dict.update.
                    claim = claim.values(
                        state=_SESSIONS.c.state.op("||")(bindparam("delta", session_delta, type_=postgresql.JSONB))
                    )
                if (await sql.execute(claim)).rowcount != 1:
                    await self._raise_lost_race(sql=sql, key=key, session=session)
            else:
                row = (await sql.execute(claim.returning(_SESSIONS.c.state))).first()
                if row is None:
                    await self._raise_lost_race(sql=sql, key=key, session=session)
                # The UPDATE above took SQLite's write lock: nobody can change the state in between.
                if session_delta:
                    merged = {**(row.state or {}), **session_delta}
                    await sql.execute(update(_SESSIONS).where(key).values(state=merged))
            if deltas["app"]:
                await self._merge_state_row(
                    sql=sql, table=_APP_STATES, keys={"app_name": session.app_name}, delta=deltas["app"], when=revision
                )
            if deltas["user"]:
                await self._merge_state_row(
                    sql=sql,
                    table=_USER_STATES,
                    keys={"app_name": session.app_name, "user_id": session.user_id},
                    delta=deltas["user"],
                    when=revision,
                )
            # Through the ORM, so that after_insert hooks on StorageEvent run in this transaction.
            sql.add(StorageEvent.from_event(session, event))
            await sql.commit()

    async def _raise_lost_race(self, *, sql: AsyncSession, key: Any, session: Session) -> None:
        # Only a lost compare-and-set pays for this read: was the session advanced, or is it gone?
        found = (await sql.execute(select(exists().where(key)))).scalar()
        if not found:
            raise SessionNotFoundError(f"Session {session.id} not found.")
        raise StaleSessionError(_STALE_SESSION_ERROR_MESSAGE)

    async def _event_stored(self, *, session: Session, event: Event) -> bool:
        async with self._read_engine.connect() as conn:
            statement = select(
                exists().where(
                    _EVENTS.c.id == event.id,
                    _EVENTS.c.app_name == session.app_name,
                    _EVENTS.c.user_id == session.user_id,
                    _EVENTS.c.session_id == session.id,
                )
            )
            return bool((await conn.execute(statement)).scalar())

    async def _merge_state_row(
        self, *, sql: AsyncSession, table: Table, keys: dict[str, str], delta: dict[str, Any], when: datetime
    ) -> dict[str, Any]:
        """Merge `delta` into an app or user state row (created if missing); the merged state."""
        if self._dialect == _POSTGRESQL:
            statement = postgresql.insert(table).values(**keys, state=delta, update_time=when)
            statement = statement.on_conflict_do_update(
                index_elements=list(keys),
                set_={
                    "state": table.c.state.op("||")(statement.excluded.state),
                    "update_time": statement.excluded.update_time,
                },
            ).returning(table.c.state)
            return dict((await sql.execute(statement)).scalar_one())
        statement = sqlite.insert(table).values(**keys, state=delta, update_time=when)
        statement = statement.on_conflict_do_update(
            index_elements=list(keys), set_={"update_time": statement.excluded.update_time}
        ).returning(table.c.state)
        current = dict((await sql.execute(statement)).scalar_one() or {})
        merged = {**current, **delta}
        if merged != current:
            await sql.execute(
                update(table).where(*(table.c[name] == value for name, value in keys.items())).values(state=merged)
            )
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

        async def create() -> Session:
            return await self._create_once(
                app_name=app_name, user_id=user_id, session_id=session_id, deltas=deltas, now=now
            )

        return await self._once_more_on_disconnect(create, what="create_session")

    async def _create_once(
        self, *, app_name: str, user_id: str, session_id: str, deltas: dict[str, dict[str, Any]], now: datetime
    ) -> Session:
        app_keys = {"app_name": app_name}
        user_keys = {"app_name": app_name, "user_id": user_id}
        async with self._rollback_on_exception_session() as sql:
            app_state = user_state = None
            if deltas["app"]:
                app_state = await self._merge_state_row(
                    sql=sql, table=_APP_STATES, keys=app_keys, delta=deltas["app"], when=now
                )
            if deltas["user"]:
                user_state = await self._merge_state_row(
                    sql=sql, table=_USER_STATES, keys=user_keys, delta=deltas["user"], when=now
                )
            insert_session = (
                _SESSIONS.insert()
                .values(
                    app_name=app_name,
                    user_id=user_id,
                    id=session_id,
                    state=deltas["session"],
                    create_time=now,
                    update_time=now,
                )
                # The shared state rows come back with the insert: no separate reads.
                .returning(
                    select(_APP_STATES.c.state)
                    .where(_APP_STATES.c.app_name == app_name)
                    .scalar_subquery()
                    .label("app_state"),
                    select(_USER_STATES.c.state)
                    .where(_USER_STATES.c.app_name == app_name, _USER_STATES.c.user_id == user_id)
                    .scalar_subquery()
                    .label("user_state"),
                )
            )
            try:
                row = (await sql.execute(insert_session)).one()
            except IntegrityError:
                raise AlreadyExistsError(f"Session with id {session_id} already exists.") from None
            if app_state is None:
                app_state = (
                    row.app_state
                    if row.app_state is not None
                    else await self._ensure_state_row(sql=sql, table=_APP_STATES, keys=app_keys, when=now)
                )
            if user_state is None:
                user_state = (
                    row.user_state
                    if row.user_state is not None
                    else await self._ensure_state_row(sql=sql, table=_USER_STATES, keys=user_keys, when=now)
                )
            await sql.commit()
        storage_session = StorageSession(app_name=app_name, user_id=user_id, id=session_id, update_time=now)
        return storage_session.to_session(state=_merge_state(app_state, user_state, deltas["session"]))

    async def _ensure_state_row(
        self, *, sql: AsyncSession, table: Table, keys: dict[str, str], when: datetime
    ) -> dict[str, Any]:
        """Create an empty app or user state row; if a concurrent creator won, its state."""
        dialect_insert = postgresql.insert if self._dialect == _POSTGRESQL else sqlite.insert
        statement = dialect_insert(table).values(**keys, state={}, update_time=when).on_conflict_do_nothing()
        if (await sql.execute(statement)).rowcount == 1:
            return {}
        existing = select(table.c.state).where(*(table.c[name] == value for name, value in keys.items()))
        return dict((await sql.execute(existing)).scalar_one() or {})

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

        async def read() -> Session | None:
            return await self._read_session(app_name=app_name, user_id=user_id, session_id=session_id, config=config)

        return await self._once_more_on_disconnect(read, what="get_session")

    async def _read_session(
        self, *, app_name: str, user_id: str, session_id: str, config: GetSessionConfig | None
    ) -> Session | None:
        session_row = (
            select(
                _SESSIONS.c.state,
                _SESSIONS.c.update_time,
                _APP_STATES.c.state.label("app_state"),
                _USER_STATES.c.state.label("user_state"),
            )
            .select_from(
                _SESSIONS.outerjoin(_APP_STATES, _APP_STATES.c.app_name == _SESSIONS.c.app_name).outerjoin(
                    _USER_STATES,
                    and_(
                        _USER_STATES.c.app_name == _SESSIONS.c.app_name, _USER_STATES.c.user_id == _SESSIONS.c.user_id
                    ),
                )
            )
            .where(_SESSIONS.c.app_name == app_name, _SESSIONS.c.user_id == user_id, _SESSIONS.c.id == session_id)
        )
        async with self._read_engine.connect() as conn:
            # The session row first: its revision can then only be older than the events read
            # next, so a racing append makes the next write stale instead of silently skipping
            # an event this copy never saw.
            row = (await conn.execute(session_row)).first()
            if row is None:
                return None
            event_rows = []
            if not (config and config.num_recent_events == 0):
                events = (
                    select(_EVENTS.c.id, _EVENTS.c.invocation_id, _EVENTS.c.timestamp, _EVENTS.c.event_data)
                    .where(
                        _EVENTS.c.app_name == app_name, _EVENTS.c.user_id == user_id, _EVENTS.c.session_id == session_id
                    )
                    .order_by(_EVENTS.c.timestamp.desc(), _EVENTS.c.id.desc())
                )
                if config and config.after_timestamp:
                    after = datetime.fromtimestamp(config.after_timestamp, tz=UTC).replace(tzinfo=None)
                    events = events.where(_EVENTS.c.timestamp >= after)
                if config and config.num_recent_events is not None:
                    events = events.limit(config.num_recent_events)
                event_rows = (await conn.execute(events)).all()
        storage_session = StorageSession(app_name=app_name, user_id=user_id, id=session_id, update_time=row.update_time)
        return storage_session.to_session(
            state=_merge_state(row.app_state or {}, row.user_state or {}, row.state or {}),
            events=[
                StorageEvent(
                    id=e.id, invocation_id=e.invocation_id, timestamp=e.timestamp, event_data=e.event_data
                ).to_event()
                for e in reversed(event_rows)
            ],
        )

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
