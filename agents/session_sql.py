"""The statements ADK's session store sends, and the two hooks the ledger installs on its append.

Built once: constructing and cache-keying a statement costs more than sending it. The hooks ride
on the event append (agents/session_store.py): a rider writes in the append's own statement
(`install_append_rider`, PostgreSQL), a fence is a condition the append must meet
(`install_append_fence`). This module knows no runs: the ledger says what each hook writes or
guards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from google.adk.events.event import Event
from google.adk.sessions.schemas.v1 import StorageAppState, StorageEvent, StorageSession, StorageUserState
from sqlalchemy import Table, and_, bindparam, column, exists, inspect, literal_column, select, text, true, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.elements import ColumnElement, TextClause

SESSIONS: Table = StorageSession.__table__
EVENTS: Table = StorageEvent.__table__
APP_STATES: Table = StorageAppState.__table__
USER_STATES: Table = StorageUserState.__table__
EVENT_MAPPER = inspect(StorageEvent)

POSTGRESQL = "postgresql"
SQLITE = "sqlite"
# One microsecond is the resolution of the revision column on both databases.
TICK = timedelta(microseconds=1)

# Built once: constructing and cache-keying a statement costs more than sending it.
THIS_SESSION = and_(
    SESSIONS.c.app_name == bindparam("k_app"),
    SESSIONS.c.user_id == bindparam("k_user"),
    SESSIONS.c.id == bindparam("k_session"),
)
APP_STATE_PRESENT = exists().where(APP_STATES.c.app_name == bindparam("k_app"))
USER_STATE_PRESENT = exists().where(
    USER_STATES.c.app_name == bindparam("k_app"), USER_STATES.c.user_id == bindparam("k_user")
)
# The stock service refuses an append whose app or user state row is missing (create_session
# makes both), so the claim matches no row then: nothing is written, and the lost race says why.
CLAIM = update(SESSIONS).where(
    THIS_SESSION, SESSIONS.c.update_time == bindparam("k_expected"), APP_STATE_PRESENT, USER_STATE_PRESENT
)
CLAIM = CLAIM.values(update_time=bindparam("k_revision"))
# jsonb || is a shallow merge, exactly dict.update.
CLAIM_AND_MERGE = CLAIM.values(state=SESSIONS.c.state.op("||")(bindparam("k_delta", type_=postgresql.JSONB)))
CLAIM_RETURNING_STATE = CLAIM.returning(SESSIONS.c.state)
SET_SESSION_STATE = update(SESSIONS).where(THIS_SESSION).values(state=bindparam("k_state"))
SESSION_EXISTS = select(exists().where(THIS_SESSION))
APP_STATE_EXISTS = select(APP_STATE_PRESENT)
USER_STATE_EXISTS = select(USER_STATE_PRESENT)
EVENT_EXISTS = select(
    exists().where(
        EVENTS.c.id == bindparam("k_event"),
        EVENTS.c.app_name == bindparam("k_app"),
        EVENTS.c.user_id == bindparam("k_user"),
        EVENTS.c.session_id == bindparam("k_session"),
    )
)
INSERT_EVENT = EVENTS.insert()
# (attribute, column) of every column StorageEvent maps.
EVENT_COLUMNS = [(prop.key, prop.columns[0].key) for prop in EVENT_MAPPER.column_attrs]


# PostgreSQL's `SET LOCAL synchronous_commit = off`, as a condition of the event row's SELECT so
# that it costs no statement of its own (set_config(…, true) is SET LOCAL; it is read at COMMIT).
COMMIT_MAY_LAG = text("set_config('synchronous_commit', 'off', true) = 'off'")


def _claim_then_insert(
    claim: Any, *, rider: Sequence[TextClause] | None = None, lagging: bool = False
) -> Any:
    """One statement: the event row is inserted only if `claim` matched the session's revision.

    With a `rider` (PostgreSQL): each of its data-modifying statements joins as a later CTE,
    reading `stored` (the inserted row, so it writes nothing when the event is not stored), still
    one statement returning the event's id.
    """
    claimed = claim.returning(SESSIONS.c.id).cte("claimed")
    row = select(*(bindparam(f"e_{column}", type_=EVENTS.c[column].type) for _, column in EVENT_COLUMNS))
    if lagging:
        row = row.where(COMMIT_MAY_LAG)
    insert = (
        EVENTS.insert()
        .from_select([column for _, column in EVENT_COLUMNS], row.select_from(claimed))
        .returning(EVENTS.c.id)
    )
    if not rider:
        return insert
    stored = insert.cte("stored")
    # Joined (LEFT, on true) rather than added: CTEs render in the order they are met, and the
    # rider must come after the `stored` it reads. It returns a row per row it wrote, hence DISTINCT.
    joined = stored
    for index, statement in enumerate(rider):
        joined = joined.outerjoin(statement.columns(column("n")).cte(f"ride_{index}"), true())
    return select(stored.c.id).distinct().select_from(joined)


APPEND = _claim_then_insert(CLAIM)
APPEND_AND_MERGE = _claim_then_insert(CLAIM_AND_MERGE)


class AppendRider(Protocol):
    """Writes that ride in an event's append statement on PostgreSQL instead of following it.

    The ledger installs one (`runs.ledger.journal.AnswersRider`: the journal rows a function response
    answers, and the effect records it finishes). `sql` gives data-modifying statements (each
    `… RETURNING 1 AS n`) that read the CTE `stored` (the event row just inserted) and bind
    `k_ride_*` parameters; `params` gives them
    for one event row, or None when the rider has nothing to write for it (the row's
    `after_insert` hooks then do everything, as on SQLite). Only the statement is shared: the
    rider and those hooks agree between themselves on who wrote what.
    """

    def sql(self) -> Sequence[TextClause]: ...

    def params(self, row: StorageEvent) -> dict[str, Any] | None: ...


riders: list[AppendRider] = []
_ridden: dict[tuple[bool, bool, bool], Any] = {}


def install_append_rider(rider: AppendRider) -> None:
    """Let `rider` write in the append statement of every later event (PostgreSQL only)."""
    riders[:] = [rider]
    _ridden.clear()


class AppendFence(Protocol):
    """A condition an event must meet to be stored, checked in the append's own statement.

    The ledger installs one (`runs.ledger.leases.EventFence`): an event of a run is stored only while
    the attempt that wrote it still holds the run. This module knows no runs: the fence says which
    events it guards (`params`, None for the others), the SQL that must hold (`condition`, binding
    `k_fence_*` parameters) and what a refused event raises (`refused`).
    """

    def condition(self, dialect: str) -> ColumnElement[bool] | TextClause: ...

    def params(self, event: Event) -> dict[str, Any] | None: ...

    def refused(self, event: Event) -> BaseException: ...


@dataclass(frozen=True)
class Fenced:
    fence: AppendFence
    claim: Any
    claim_and_merge: Any
    append: Any
    append_and_merge: Any
    claim_returning_state: Any
    holds: Any


_fences: dict[str, Fenced] = {}
_installed: list[AppendFence] = []


def install_append_fence(fence: AppendFence) -> None:
    """Guard every later append with `fence` (statements built once per dialect, on first use)."""
    _installed[:] = [fence]
    _fences.clear()
    _ridden.clear()


def fenced_for(dialect: str) -> Fenced | None:
    if not _installed:
        return None
    built = _fences.get(dialect)
    if built is None or built.fence is not _installed[0]:
        fence = _installed[0]
        condition = fence.condition(dialect)
        built = Fenced(
            fence=fence,
            claim=CLAIM.where(condition),
            claim_and_merge=CLAIM_AND_MERGE.where(condition),
            append=_claim_then_insert(CLAIM.where(condition)),
            append_and_merge=_claim_then_insert(CLAIM_AND_MERGE.where(condition)),
            claim_returning_state=CLAIM_RETURNING_STATE.where(condition),
            holds=select(literal_column("1")).where(condition),
        )
        _fences[dialect] = built
    return built


def append_statement(fenced: Fenced | None, *, merge: bool, ride: bool, lagging: bool) -> Any:
    """The PostgreSQL append statement of one shape (built once per shape)."""
    if not ride and not lagging:
        if fenced is not None:
            return fenced.append_and_merge if merge else fenced.append
        return APPEND_AND_MERGE if merge else APPEND
    key = (fenced is not None, merge, ride, lagging)
    built = _ridden.get(key)
    if built is None:
        if fenced is not None:
            claim = fenced.claim_and_merge if merge else fenced.claim
        else:
            claim = CLAIM_AND_MERGE if merge else CLAIM
        built = _ridden[key] = _claim_then_insert(
            claim, rider=riders[0].sql() if ride else None, lagging=lagging
        )
    return built


def commit_may_lag(event: Event) -> bool:
    """Whether an event's commit may reach the disk after the append returns (PostgreSQL).

    Only an event without function calls: nothing acts on it before the next write that must be
    durable. A function call's event (and the journal row written with it) is what a tool waits
    for; it commits synchronously, and so flushes the write-ahead log up to it, every lagging
    event before it included. The settle, effect records and every other write keep the
    server's setting. A lagging commit is visible at once and survives any crash of the client;
    only a crash of the database server within its WAL writer delay (200 ms by default) can lose
    it, and then it is lost together with everything after it in the log, never out of order.
    """
    return not event.get_function_calls()


APP_STATE_OF = select(APP_STATES.c.state).where(APP_STATES.c.app_name == bindparam("k_app"))
USER_STATE_OF = select(USER_STATES.c.state).where(
    USER_STATES.c.app_name == bindparam("k_app"), USER_STATES.c.user_id == bindparam("k_user")
)
INSERT_SESSION = (
    SESSIONS.insert()
    .values(
        app_name=bindparam("k_app"),
        user_id=bindparam("k_user"),
        id=bindparam("k_session"),
        state=bindparam("k_state"),
        create_time=bindparam("k_now"),
        update_time=bindparam("k_now"),
    )
    # The shared state rows come back with the insert: no separate reads.
    .returning(
        APP_STATE_OF.scalar_subquery().label("app_state"),
        USER_STATE_OF.scalar_subquery().label("user_state"),
    )
)
# A new session precedes no side effect either (commit_may_lag): its commit may lag the same way.
INSERT_SESSION_LAGGING = INSERT_SESSION.returning(
    literal_column("set_config('synchronous_commit', 'off', true)").label("commit_lags")
)
READ_SESSION = (
    select(
        SESSIONS.c.state,
        SESSIONS.c.update_time,
        APP_STATES.c.state.label("app_state"),
        USER_STATES.c.state.label("user_state"),
    )
    .select_from(
        SESSIONS.outerjoin(APP_STATES, APP_STATES.c.app_name == SESSIONS.c.app_name).outerjoin(
            USER_STATES,
            and_(USER_STATES.c.app_name == SESSIONS.c.app_name, USER_STATES.c.user_id == SESSIONS.c.user_id),
        )
    )
    .where(THIS_SESSION)
)
READ_EVENTS = (
    select(EVENTS.c.id, EVENTS.c.invocation_id, EVENTS.c.timestamp, EVENTS.c.event_data)
    .where(
        EVENTS.c.app_name == bindparam("k_app"),
        EVENTS.c.user_id == bindparam("k_user"),
        EVENTS.c.session_id == bindparam("k_session"),
    )
    .order_by(EVENTS.c.timestamp.desc(), EVENTS.c.id.desc())
)
READ_EVENTS_AFTER = READ_EVENTS.where(EVENTS.c.timestamp >= bindparam("k_after"))
