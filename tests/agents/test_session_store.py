"""The session store keeps every promise of ADK's DatabaseSessionService, at fewer statements.

The behaviours follow ADK's own contract suite for session services (tests/unittests/sessions
in google/adk-python), run against `agents.session_store.SessionStore` on the test database
(SQLite by default, PostgreSQL with DATABASE_URL), plus what only a shared database shows:
stale writers in other processes, the stock service reading and writing the same rows, the
tool journal riding in the event's transaction, and a dead pooled connection.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest
from django.db import connection
from google.adk.errors._stale_session_error import StaleSessionError
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.errors.session_not_found_error import SessionNotFoundError
from google.adk.events.event import Event
from google.adk.events.event_actions import EventActions
from google.adk.sessions.base_session_service import GetSessionConfig
from google.adk.sessions.database_session_service import DatabaseSessionService
from google.genai import types
from sqlalchemy import event as sqlalchemy_event
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from agents.adk import adk_database_url, create_adk_engine, create_session_service, run_coroutine
from agents.models import AdkEvent
from agents.session_store import SessionStore
from runs.ledger import effects
from runs.models.effects import EffectStatus, ToolEffect
from runs.models.ledger import ToolCall, ToolCallStatus
from tests.factories import make_run
from tests.helpers import BASE_DIR, child_env, postgres_only

# ADK's session service writes through its own SQLAlchemy engine; two processes race on one session.
pytestmark = pytest.mark.django_db(transaction=True)

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    return run_coroutine(coro)


@pytest.fixture
def store() -> Iterator[SessionStore]:
    service = run(_make_store())
    yield service
    run(service.db_engine.dispose())


async def _make_store() -> SessionStore:
    return create_session_service()


@pytest.fixture
def stock() -> Iterator[DatabaseSessionService]:
    """ADK's own service on the same database, as `adk web` would open it."""

    async def make() -> DatabaseSessionService:
        return DatabaseSessionService(db_engine=create_adk_engine())

    service = run(make())
    yield service
    run(service.db_engine.dispose())


@pytest.fixture
def app() -> str:
    # ADK's tables are not Django's: rows outlive a test, so every test gets its own app.
    return f"app-{uuid.uuid4().hex[:12]}"


def user_event(*, invocation_id: str = "inv", state_delta: dict | None = None, **fields: Any) -> Event:
    return Event(
        invocation_id=invocation_id, author="user", actions=EventActions(state_delta=state_delta or {}), **fields
    )


@contextmanager
def statements(service: DatabaseSessionService) -> Iterator[list[str]]:
    """The SQL statements (and COMMITs) `service` sends while the block runs."""
    sent: list[str] = []

    def on_statement(conn, cursor, statement, parameters, context, executemany):
        sent.append(statement.split(None, 1)[0].upper())

    def on_commit(conn):
        sent.append("COMMIT")

    engine = service.db_engine.sync_engine
    sqlalchemy_event.listen(engine, "before_cursor_execute", on_statement)
    sqlalchemy_event.listen(engine, "commit", on_commit)
    try:
        yield sent
    finally:
        sqlalchemy_event.remove(engine, "before_cursor_execute", on_statement)
        sqlalchemy_event.remove(engine, "commit", on_commit)


# --- ADK's contract ---------------------------------------------------------------------------------


def test_a_missing_session_is_none(store, app):
    assert run(store.get_session(app_name=app, user_id="u", session_id="nope")) is None


def test_create_get_delete(store, app):
    created = run(store.create_session(app_name=app, user_id="u", state={"key": "value"}))
    assert created.id and created.app_name == app and created.user_id == "u"
    assert created.state == {"key": "value"}
    assert created.last_update_time <= datetime.now(UTC).timestamp()

    assert run(store.get_session(app_name=app, user_id="u", session_id=created.id)) == created

    run(store.delete_session(app_name=app, user_id="u", session_id=created.id))
    assert run(store.get_session(app_name=app, user_id="u", session_id=created.id)) is None


def test_create_with_an_existing_id_is_refused_and_changes_nothing(store, app):
    run(store.create_session(app_name=app, user_id="u", session_id="s", state={"k": 1}))
    with pytest.raises(AlreadyExistsError):
        run(store.create_session(app_name=app, user_id="u", session_id="s", state={"k": 2, "app:a": 1}))
    got = run(store.get_session(app_name=app, user_id="u", session_id="s"))
    assert got.state == {"k": 1}


def test_list_sessions_per_user_and_for_all_users_oldest_first(store, app):
    for user, session_id in [("u1", "a"), ("u1", "b"), ("u2", "c")]:
        run(store.create_session(app_name=app, user_id=user, session_id=session_id, state={"key": session_id}))
    # Appending moves "a" to the end: the list is ordered by last update, oldest first.
    a = run(store.get_session(app_name=app, user_id="u1", session_id="a"))
    run(store.append_event(a, user_event(timestamp=time.time() + 5)))

    mine = run(store.list_sessions(app_name=app, user_id="u1")).sessions
    assert [s.id for s in mine] == ["b", "a"]
    assert {s.id: s.state for s in mine} == {"a": {"key": "a"}, "b": {"key": "b"}}
    assert all(s.events == [] for s in mine)

    everyone = run(store.list_sessions(app_name=app)).sessions
    assert [s.id for s in everyone] == ["b", "c", "a"]


def test_app_state_is_shared_by_every_user_of_the_app(store, app):
    s1 = run(store.create_session(app_name=app, user_id="u1", session_id="s1", state={"app:k1": "v1"}))
    run(store.append_event(s1, user_event(state_delta={"app:k2": "v2"})))

    s2 = run(store.create_session(app_name=app, user_id="u2", session_id="s2"))
    assert s2.state == {"app:k1": "v1", "app:k2": "v2"}
    again = run(store.get_session(app_name=app, user_id="u1", session_id="s1"))
    assert again.state == {"app:k1": "v1", "app:k2": "v2"}


def test_user_state_is_shared_by_that_users_sessions_only(store, app):
    s1 = run(store.create_session(app_name=app, user_id="u1", session_id="s1", state={"user:k1": "v1"}))
    run(store.append_event(s1, user_event(state_delta={"user:k2": "v2"})))

    assert run(store.create_session(app_name=app, user_id="u1", session_id="s1b")).state == {
        "user:k1": "v1",
        "user:k2": "v2",
    }
    assert run(store.create_session(app_name=app, user_id="u2", session_id="s2")).state == {}
    assert run(store.get_user_state(app_name=app, user_id="u1")) == {"k1": "v1", "k2": "v2"}
    assert run(store.get_user_state(app_name=app, user_id="nobody")) == {}


def test_session_state_stays_in_its_session(store, app):
    s1 = run(store.create_session(app_name=app, user_id="u1", session_id="s1", state={"sk1": "v1"}))
    run(store.append_event(s1, user_event(state_delta={"sk2": "v2"})))

    got = run(store.get_session(app_name=app, user_id="u1", session_id="s1"))
    assert got.state == {"sk1": "v1", "sk2": "v2"}
    assert run(store.create_session(app_name=app, user_id="u1", session_id="s1b")).state == {}


def test_state_deltas_replace_top_level_keys_like_dict_update(store, app):
    session = run(store.create_session(app_name=app, user_id="u", state={"nested": {"a": 1, "b": 2}, "gone": 1}))
    run(store.append_event(session, user_event(state_delta={"nested": {"c": 3}, "gone": None, "app:n": {"x": 1}})))
    run(store.append_event(session, user_event(state_delta={"app:n": {"y": 2}})))

    got = run(store.get_session(app_name=app, user_id="u", session_id=session.id))
    assert got.state == {"nested": {"c": 3}, "gone": None, "app:n": {"y": 2}}
    assert got.state == session.state


def test_temp_state_is_seen_in_memory_but_never_stored(store, app):
    session = run(store.create_session(app_name=app, user_id="u", session_id="s"))
    run(store.append_event(session, user_event(state_delta={"temp:k1": "v1", "sk": "v2"})))
    assert session.state["temp:k1"] == "v1"

    got = run(store.get_session(app_name=app, user_id="u", session_id="s"))
    assert got.state == {"sk": "v2"}
    assert got.events[0].actions.state_delta == {"sk": "v2"}


def test_get_session_respects_the_user(store, app):
    s1 = run(store.create_session(app_name=app, user_id="u1", session_id="s1"))
    run(store.append_event(s1, user_event()))
    run(store.create_session(app_name=app, user_id="u2", session_id="s1"))

    got = run(store.get_session(app_name=app, user_id="u2", session_id="s1"))
    assert got.user_id == "u2"
    assert got.events == []


def test_a_complete_event_reads_back_equal(store, app):
    session = run(store.create_session(app_name=app, user_id="u"))
    event = Event(
        invocation_id="invocation",
        author="user",
        content=types.Content(
            role="user",
            parts=[types.Part(text="hello"), types.Part.from_bytes(data=b"\x89PNG image", mime_type="image/png")],
        ),
        turn_complete=True,
        partial=False,
        actions=EventActions(artifact_delta={"file": 0}, transfer_to_agent="agent", escalate=True),
        long_running_tool_ids={"tool1"},
        error_code="error_code",
        error_message="error_message",
        interrupted=True,
        grounding_metadata=types.GroundingMetadata(
            web_search_queries=["query1"], search_entry_point=types.SearchEntryPoint(sdk_blob=b"blob")
        ),
        usage_metadata=types.GenerateContentResponseUsageMetadata(
            prompt_token_count=1, candidates_token_count=1, total_token_count=2
        ),
        custom_metadata={"custom_key": "custom_value"},
        input_transcription=types.Transcription(text="in", finished=True),
    )
    run(store.append_event(session, event))

    got = run(store.get_session(app_name=app, user_id="u", session_id=session.id))
    assert got == session
    assert got.events[0].content.parts[1].inline_data.data == b"\x89PNG image"


def test_last_update_time_follows_the_event(store, app):
    session = run(store.create_session(app_name=app, user_id="u"))
    created_at = session.last_update_time
    run(store.append_event(session, user_event(timestamp=created_at + 10)))

    assert session.last_update_time == pytest.approx(created_at + 10, abs=1e-6)
    got = run(store.get_session(app_name=app, user_id="u", session_id=session.id))
    assert got.last_update_time == pytest.approx(created_at + 10, abs=1e-6)


def test_get_session_filters_recent_events_and_after_a_timestamp(store, app):
    session = run(store.create_session(app_name=app, user_id="u"))
    base = time.time()
    for i in range(1, 6):
        run(store.append_event(session, user_event(invocation_id=f"inv{i}", timestamp=base + i)))

    def invocations(config: GetSessionConfig | None) -> list[str]:
        got = run(store.get_session(app_name=app, user_id="u", session_id=session.id, config=config))
        return [e.invocation_id for e in got.events]

    assert invocations(None) == ["inv1", "inv2", "inv3", "inv4", "inv5"]
    assert invocations(GetSessionConfig(num_recent_events=3)) == ["inv3", "inv4", "inv5"]
    assert invocations(GetSessionConfig(after_timestamp=base + 4)) == ["inv4", "inv5"]
    assert invocations(GetSessionConfig(after_timestamp=base + 50)) == []
    assert invocations(GetSessionConfig(after_timestamp=base + 2, num_recent_events=2)) == ["inv4", "inv5"]
    assert invocations(GetSessionConfig(num_recent_events=0)) == []


def test_events_with_the_same_timestamp_keep_one_order(store, app):
    session = run(store.create_session(app_name=app, user_id="u"))
    moment = time.time() + 1
    for i in range(4):
        run(store.append_event(session, user_event(invocation_id=f"inv{i}", timestamp=moment)))
    first = run(store.get_session(app_name=app, user_id="u", session_id=session.id))
    second = run(store.get_session(app_name=app, user_id="u", session_id=session.id))
    assert [e.id for e in first.events] == [e.id for e in second.events]
    assert len(first.events) == 4
    # Four revisions for one timestamp: each append still moved the revision forward.
    assert first.last_update_time > moment


def test_partial_events_are_not_stored(store, app):
    session = run(store.create_session(app_name=app, user_id="u"))
    with statements(store) as sent:
        run(store.append_event(session, Event(author="user", partial=True)))
    assert sent == []
    assert session.events == []
    assert run(store.get_session(app_name=app, user_id="u", session_id=session.id)).events == []


def test_appending_to_a_deleted_session_says_so(store, app):
    session = run(store.create_session(app_name=app, user_id="u"))
    run(store.delete_session(app_name=app, user_id="u", session_id=session.id))
    with pytest.raises(SessionNotFoundError):
        run(store.append_event(session, user_event()))


def _drop_state_row(service: DatabaseSessionService, app: str, scope: str) -> None:
    table = "app_states" if scope == "app" else "user_states"

    async def drop() -> None:
        async with service.db_engine.begin() as conn:
            await conn.execute(text(f"DELETE FROM {table} WHERE app_name = :a"), {"a": app})

    run(drop())


def _state_rows(service: DatabaseSessionService, app: str) -> tuple[int, int, int]:
    async def count() -> tuple[int, int, int]:
        async with service.db_engine.connect() as conn:
            counts = []
            for table in ("app_states", "user_states", "events"):
                sql = text(f"SELECT count(*) FROM {table} WHERE app_name = :a")
                counts.append((await conn.execute(sql, {"a": app})).scalar())
            return tuple(counts)

    return run(count())


@pytest.mark.parametrize("scope", ["app", "user"])
@pytest.mark.parametrize("delta", [{}, {"app:k": 1, "user:k": 1, "k": 1}], ids=["no delta", "with deltas"])
def test_a_missing_state_row_refuses_the_append_as_the_stock_service_does(store, stock, app, scope, delta):
    refusals = []
    for service in (stock, store):
        session = run(service.create_session(app_name=app, user_id=f"u-{len(refusals)}"))
        run(service.append_event(session, user_event(invocation_id="first")))
        _drop_state_row(service, app, scope)
        before = _state_rows(service, app)
        with pytest.raises(ValueError) as refused:
            run(service.append_event(session, user_event(invocation_id="refused", state_delta=dict(delta))))
        refusals.append(str(refused.value).replace(f"u-{len(refusals)}", "<user>"))
        # Nothing written, and the row is not made again behind the caller's back.
        assert _state_rows(service, app) == before
        stored = run(service.get_session(app_name=app, user_id=session.user_id, session_id=session.id))
        assert [event.invocation_id for event in stored.events] == ["first"]
        assert [event.invocation_id for event in session.events] == ["first"]
    stock_refusal, store_refusal = refusals
    assert store_refusal == stock_refusal
    assert f"{scope.capitalize()} state missing for app_name={app!r}" in store_refusal


def test_a_state_row_deleted_between_the_claim_and_the_merge_is_not_made_again(store, app, monkeypatch):
    session = run(store.create_session(app_name=app, user_id="u"))
    real = SessionStore._merge_state_row

    def deleted_first(self, conn, table, keys, delta, when, *, create=True):
        conn.execute(table.delete().where(*(table.c[name] == value for name, value in keys.items())))
        return real(self, conn, table, keys, delta, when, create=create)

    monkeypatch.setattr(SessionStore, "_merge_state_row", deleted_first)
    with pytest.raises(ValueError, match="User state missing"):
        run(store.append_event(session, user_event(state_delta={"user:k": 1})))
    monkeypatch.undo()
    # The whole append was rolled back: the delete with it, and no event.
    assert _state_rows(store, app) == (1, 1, 0)


# --- Stale writers ----------------------------------------------------------------------------------


def test_a_stale_copy_is_refused_and_writes_nothing(store, app):
    original = run(store.create_session(app_name=app, user_id="u", state={"sk": 0}))
    run(store.append_event(original, user_event(invocation_id="inv1", state_delta={"sk": 1})))
    newer = run(store.get_session(app_name=app, user_id="u", session_id=original.id))
    run(store.append_event(newer, user_event(invocation_id="inv2", state_delta={"sk": 2})))

    with pytest.raises(StaleSessionError):
        run(store.append_event(original, user_event(invocation_id="inv3", state_delta={"sk": 3, "app:a": 3})))

    stored = run(store.get_session(app_name=app, user_id="u", session_id=original.id))
    assert [e.invocation_id for e in stored.events] == ["inv1", "inv2"]
    assert stored.state == {"sk": 2}
    # The refused event never reached the caller's copy either.
    assert [e.invocation_id for e in original.events] == ["inv1"]

    # Reloading is the way forward.
    run(store.append_event(stored, user_event(invocation_id="inv3")))
    assert len(run(store.get_session(app_name=app, user_id="u", session_id=original.id)).events) == 3


def test_a_backdated_event_cannot_bring_an_old_revision_back(store, app):
    session = run(store.create_session(app_name=app, user_id="u"))
    old_copy = run(store.get_session(app_name=app, user_id="u", session_id=session.id))
    # Timestamped before the revision it replaces: storing the event's time as the revision
    # would let old_copy match again after a second backdated append.
    run(store.append_event(session, user_event(invocation_id="a", timestamp=1.0)))
    run(store.append_event(session, user_event(invocation_id="b", timestamp=2.0)))
    with pytest.raises(StaleSessionError):
        run(store.append_event(old_copy, user_event(invocation_id="c")))
    got = run(store.get_session(app_name=app, user_id="u", session_id=session.id))
    assert [(e.invocation_id, e.timestamp) for e in got.events] == [("a", 1.0), ("b", 2.0)]


def test_concurrent_appends_through_one_copy_in_one_process_are_serialised(store, app):
    session = run(store.create_session(app_name=app, user_id="u"))

    async def both() -> None:
        await asyncio.gather(*(store.append_event(session, user_event(invocation_id=f"inv{i}")) for i in range(5)))

    run(both())
    got = run(store.get_session(app_name=app, user_id="u", session_id=session.id))
    assert sorted(e.invocation_id for e in got.events) == [f"inv{i}" for i in range(5)]


_CONTENDER = """
import asyncio, sys, time
import django
django.setup()
from google.adk.errors._stale_session_error import StaleSessionError
from google.adk.events.event import Event
from google.adk.events.event_actions import EventActions
from agents.adk import create_session_service

APP, NAME = sys.argv[1], sys.argv[2]

async def main():
    store = create_session_service()
    for line in sys.stdin:
        round_number = int(line)
        session = await store.get_session(app_name=APP, user_id="u", session_id="shared")
        print(f"ready {round_number}", flush=True)
        sys.stdin.readline()  # "go": the other process holds the same revision now
        event = Event(
            invocation_id=f"{NAME}-{round_number}",
            author="user",
            actions=EventActions(state_delta={"round": round_number, "winner": NAME, "user:last": NAME}),
        )
        try:
            await store.append_event(session, event)
            print(f"won {round_number}", flush=True)
        except StaleSessionError:
            print(f"stale {round_number}", flush=True)
    await store.close()
    await store.db_engine.dispose()

asyncio.run(main())
"""


@pytest.mark.slow
@postgres_only
@pytest.mark.postgres
def test_two_processes_appending_to_one_revision_exactly_one_wins(store, app):
    run(store.create_session(app_name=app, user_id="u", session_id="shared"))
    rounds = 15
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CONTENDER, app, name],
            cwd=BASE_DIR,
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("left", "right")
    ]
    winners = []
    try:
        for round_number in range(rounds):
            for child in children:
                child.stdin.write(f"{round_number}\n")
                child.stdin.flush()
            for child in children:
                assert child.stdout.readline().split() == ["ready", str(round_number)], child.stderr.read()
            for child in children:
                child.stdin.write("go\n")
                child.stdin.flush()
            results = {name: child.stdout.readline().split()[0] for name, child in zip(("left", "right"), children)}
            assert sorted(results.values()) == ["stale", "won"], results
            winners.append(next(name for name, result in results.items() if result == "won"))
    finally:
        for child in children:
            child.stdin.close()
        for child in children:
            child.wait(timeout=60)
    assert [child.returncode for child in children] == [0, 0]

    stored = run(store.get_session(app_name=app, user_id="u", session_id="shared"))
    # Every round left exactly its winner's event, and the state of the last winner, whole.
    assert [e.invocation_id for e in stored.events] == [f"{w}-{n}" for n, w in enumerate(winners)]
    assert stored.state == {"round": rounds - 1, "winner": winners[-1], "user:last": winners[-1]}


# --- One database, two services -----------------------------------------------------------------


def test_the_stock_service_and_the_store_read_and_extend_each_others_sessions(store, stock, app):
    mine = run(store.create_session(app_name=app, user_id="u", state={"a": 1, "app:x": 1, "user:y": 1}))
    run(store.append_event(mine, user_event(invocation_id="store-1", state_delta={"b": 2})))

    theirs = run(stock.get_session(app_name=app, user_id="u", session_id=mine.id))
    assert theirs == mine
    run(stock.append_event(theirs, user_event(invocation_id="stock-1", state_delta={"c": 3, "user:y": 2})))

    # The store sees the stock service's write as a newer revision of the same row...
    with pytest.raises(StaleSessionError):
        run(store.append_event(mine, user_event(invocation_id="store-stale")))
    # ...and continues from a fresh copy, which the stock service can continue from in turn.
    again = run(store.get_session(app_name=app, user_id="u", session_id=mine.id))
    assert again == theirs
    run(store.append_event(again, user_event(invocation_id="store-2")))
    final = run(stock.get_session(app_name=app, user_id="u", session_id=mine.id))
    run(stock.append_event(final, user_event(invocation_id="stock-2")))

    both = run(store.get_session(app_name=app, user_id="u", session_id=mine.id))
    assert [e.invocation_id for e in both.events] == ["store-1", "stock-1", "store-2", "stock-2"]
    assert both.state == {"a": 1, "b": 2, "c": 3, "app:x": 1, "user:y": 2}
    assert run(stock.list_sessions(app_name=app, user_id="u")) == run(store.list_sessions(app_name=app, user_id="u"))


def test_a_session_the_stock_service_created_is_extended_by_the_store(store, stock, app):
    theirs = run(stock.create_session(app_name=app, user_id="u", state={"app:k": "v"}))
    mine = run(store.get_session(app_name=app, user_id="u", session_id=theirs.id))
    run(store.append_event(mine, user_event(state_delta={"k": 1})))
    assert run(stock.get_session(app_name=app, user_id="u", session_id=theirs.id)) == mine


# --- What an append costs ---------------------------------------------------------------------------


# PostgreSQL claims the revision and inserts the event in one statement (WITH claimed AS (UPDATE
# …) INSERT …); SQLite has no data-modifying CTE and sends the UPDATE and the INSERT apart.
CLAIM_AND_INSERT = ["WITH"] if connection.vendor == "postgresql" else ["UPDATE", "INSERT"]


def test_an_event_without_state_is_one_claim_and_insert_and_a_commit(store, app):
    session = run(store.create_session(app_name=app, user_id="u"))
    with statements(store) as sent:
        run(store.append_event(session, user_event(content=types.Content(role="user", parts=[types.Part(text="hi")]))))
    assert sent == [*CLAIM_AND_INSERT, "COMMIT"]


def test_state_tables_are_written_only_for_their_own_delta(store, app):
    session = run(store.create_session(app_name=app, user_id="u"))
    with statements(store) as session_delta:
        run(store.append_event(session, user_event(state_delta={"k": 1, "temp:t": 1})))
    with statements(store) as user_delta:
        run(store.append_event(session, user_event(state_delta={"user:k": 1})))
    # PostgreSQL merges the session's JSON in the claim itself; SQLite reads it back under its
    # write lock and writes it in a second UPDATE.
    if connection.vendor == "postgresql":
        assert session_delta == ["WITH", "COMMIT"]
        assert user_delta == ["WITH", "UPDATE", "COMMIT"]
    else:
        assert session_delta == ["UPDATE", "UPDATE", "INSERT", "COMMIT"]
        assert user_delta == ["UPDATE", "INSERT", "UPDATE", "UPDATE", "COMMIT"]


def test_creating_and_reading_a_session_cost_one_and_two_statements(store, app):
    run(store.prepare_tables())  # once per service: schema version and tables checked
    with statements(store) as first:
        run(store.create_session(app_name=app, user_id="u", session_id="first"))
    # The first session of an app and user creates their state rows; no read is needed for that.
    assert first == ["INSERT", "INSERT", "INSERT", "COMMIT"]
    with statements(store) as created:
        run(store.create_session(app_name=app, user_id="u", session_id="second"))
    with statements(store) as read:
        run(store.get_session(app_name=app, user_id="u", session_id="second"))
    assert created == ["INSERT", "COMMIT"]
    assert read == ["SELECT", "SELECT"]


# --- The tool journal rides in the event's transaction ----------------------------------------------


def _function_call_event(run_id: uuid.UUID, call_id: str) -> Event:
    return Event(
        invocation_id="inv",
        author="support",
        custom_metadata={"run_id": str(run_id)},
        content=types.Content(
            role="model",
            parts=[types.Part(function_call=types.FunctionCall(id=call_id, name="send_email", args={"to": "j@x"}))],
        ),
    )


def test_a_function_call_is_journaled_with_its_event_and_not_without_it(store, app):
    ledger_run = make_run()
    session = run(store.create_session(app_name=app, user_id="u"))
    stale = run(store.get_session(app_name=app, user_id="u", session_id=session.id))

    run(store.append_event(session, _function_call_event(ledger_run.run_id, "call-1")))
    call = ToolCall.objects.get(run=ledger_run)
    assert (call.call_id, call.tool_name, call.status, call.args) == (
        "call-1",
        "send_email",
        ToolCallStatus.CALLED,
        {"to": "j@x"},
    )
    assert AdkEvent.objects.filter(session_id=session.id).count() == 1

    # A refused event takes its journal row with it: neither is stored.
    with pytest.raises(StaleSessionError):
        run(store.append_event(stale, _function_call_event(ledger_run.run_id, "call-2")))
    assert list(ToolCall.objects.filter(run=ledger_run).values_list("call_id", flat=True)) == ["call-1"]
    assert AdkEvent.objects.filter(session_id=session.id).count() == 1


def _function_response_event(run_id: uuid.UUID, call_id: str) -> Event:
    return Event(
        invocation_id="inv",
        author="support",
        custom_metadata={"run_id": str(run_id)},
        content=types.Content(
            role="user",
            parts=[types.Part(function_response=types.FunctionResponse(id=call_id, name="send_email",
                                                                       response={"status": "sent"}))],
        ),
    )


def test_a_function_response_answers_its_call_in_the_events_own_statement(store, app):
    ledger_run = make_run()
    session = run(store.create_session(app_name=app, user_id="u"))
    run(store.append_event(session, _function_call_event(ledger_run.run_id, "call-1")))
    stale = run(store.get_session(app_name=app, user_id="u", session_id=session.id))
    run(store.append_event(session, user_event(content=types.Content(role="user", parts=[types.Part(text="x")]))))

    # A refused answer leaves the call as it was.
    with pytest.raises(StaleSessionError):
        run(store.append_event(stale, _function_response_event(ledger_run.run_id, "call-1")))
    assert ToolCall.objects.get(run=ledger_run).status == ToolCallStatus.CALLED

    with statements(store) as sent:
        run(store.append_event(session, _function_response_event(ledger_run.run_id, "call-1")))
    call = ToolCall.objects.get(run=ledger_run)
    assert (call.status, json.loads(call.response_summary)) == (ToolCallStatus.ANSWERED, {"status": "sent"})
    assert call.answered_at is not None
    # PostgreSQL: one statement (the answer is a CTE of the append); SQLite: the hook's UPDATE after it.
    assert sent == (["WITH", "COMMIT"] if connection.vendor == "postgresql" else ["UPDATE", "INSERT", "UPDATE", "COMMIT"])


def test_a_function_response_finishes_the_effect_record_its_call_started_in_the_same_write(store, app):
    ledger_run = make_run()
    session = run(store.create_session(app_name=app, user_id="u"))
    run(store.append_event(session, _function_call_event(ledger_run.run_id, "call-1")))
    claim = effects.claim_effect(run_id=ledger_run.run_id, call_id="call-1", intent=f"run:{ledger_run.run_id}",
                                 tool="send_email", business_key="j@x", stable_fields={})
    assert claim.kind == "run"
    stale = run(store.get_session(app_name=app, user_id="u", session_id=session.id))
    run(store.append_event(session, user_event(content=types.Content(role="user", parts=[types.Part(text="x")]))))

    # A response that is not stored finishes nothing: the record stays started (in doubt).
    with pytest.raises(StaleSessionError):
        run(store.append_event(stale, _function_response_event(ledger_run.run_id, "call-1")))
    assert ToolEffect.objects.get(key=claim.key).status == EffectStatus.STARTED

    with statements(store) as sent:
        run(store.append_event(session, _function_response_event(ledger_run.run_id, "call-1")))
    record = ToolEffect.objects.get(key=claim.key)
    assert (record.status, record.result) == (EffectStatus.DONE, {"status": "sent"})
    assert record.finished_at is not None
    # PostgreSQL: still one statement (a CTE beside the answer); SQLite: one UPDATE more in the hook.
    assert sent == (
        ["WITH", "COMMIT"] if connection.vendor == "postgresql" else ["UPDATE", "INSERT", "UPDATE", "UPDATE", "COMMIT"]
    )


def test_a_response_does_not_finish_a_record_whose_tool_raised(store, app):
    ledger_run = make_run()
    session = run(store.create_session(app_name=app, user_id="u"))
    run(store.append_event(session, _function_call_event(ledger_run.run_id, "call-1")))
    claim = effects.claim_effect(run_id=ledger_run.run_id, call_id="call-1", intent=f"run:{ledger_run.run_id}",
                                 tool="send_email", business_key="j@x", stable_fields={})
    effects.note_effect_error(key=claim.key, run_id=ledger_run.run_id, call_id="call-1", error="RuntimeError: boom")
    run(store.append_event(session, _function_response_event(ledger_run.run_id, "call-1")))
    # It may have acted before raising: an answer built around the error does not say it is done.
    assert ToolEffect.objects.get(key=claim.key).status == EffectStatus.STARTED


@contextmanager
def commit_settings(service: SessionStore) -> Iterator[list[str]]:
    """synchronous_commit as each of `service`'s transactions commits (PostgreSQL)."""
    seen: list[str] = []

    def on_commit(conn):
        seen.append(conn.exec_driver_sql("SHOW synchronous_commit").scalar())

    engine = service.db_engine.sync_engine
    sqlalchemy_event.listen(engine, "commit", on_commit)
    try:
        yield seen
    finally:
        sqlalchemy_event.remove(engine, "commit", on_commit)


@postgres_only
def test_only_events_without_function_calls_commit_without_waiting_for_the_disk(store, app):
    ledger_run = make_run()
    run(store.prepare_tables())  # once per service, before anything it stores
    with commit_settings(store) as seen:
        session = run(store.create_session(app_name=app, user_id="u"))
        run(store.append_event(session, user_event(content=types.Content(role="user", parts=[types.Part(text="hi")]))))
        run(store.append_event(session, _function_call_event(ledger_run.run_id, "call-1")))
        run(store.append_event(session, _function_response_event(ledger_run.run_id, "call-1")))
        run(store.append_event(session, user_event(state_delta={"k": 1})))
    # The session, the user's message, the call (its tool waits for it), its answer, a state change.
    assert seen == ["off", "off", "on", "off", "off"]


@postgres_only
def test_every_commit_waits_for_the_disk_when_lagging_commits_are_off(app):
    async def make() -> SessionStore:
        return SessionStore(db_engine=create_adk_engine(), lagging_commits=False)

    strict = run(make())
    try:
        run(strict.prepare_tables())
        with commit_settings(strict) as seen:
            session = run(strict.create_session(app_name=app, user_id="u"))
            run(strict.append_event(session, user_event(content=types.Content(role="user", parts=[types.Part(text="hi")]))))
        assert seen == ["on", "on"]
    finally:
        run(strict.db_engine.dispose())


# --- A dead pooled connection ----------------------------------------------------------------------


@postgres_only
@pytest.mark.postgres
def test_a_connection_killed_while_pooled_costs_one_retry_and_no_duplicate(app):
    name = f"store-{uuid.uuid4().hex[:8]}"

    async def make() -> SessionStore:
        engine = create_async_engine(
            adk_database_url(), pool_size=1, max_overflow=0, connect_args={"application_name": name}
        )
        return SessionStore(db_engine=engine)

    store = run(make())
    try:
        session = run(store.create_session(app_name=app, user_id="u"))

        def kill_pooled_connection() -> None:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s", [name]
                )
                assert cursor.fetchone()[0] == 1
            # pg_terminate_backend only signals: wait until the backend is gone.
            for _ in range(100):
                with connection.cursor() as cursor:
                    cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [name])
                    if cursor.fetchone()[0] == 0:
                        return
                time.sleep(0.05)

        kill_pooled_connection()
        run(store.append_event(session, user_event(invocation_id="after-kill", state_delta={"k": 1})))
        kill_pooled_connection()
        got = run(store.get_session(app_name=app, user_id="u", session_id=session.id))
        assert [e.invocation_id for e in got.events] == ["after-kill"]
        assert got.state == {"k": 1}
        assert got == session

        kill_pooled_connection()
        run(store.append_event(got, user_event(invocation_id="second")))
        assert [
            e.invocation_id for e in run(store.get_session(app_name=app, user_id="u", session_id=session.id)).events
        ] == [
            "after-kill",
            "second",
        ]
    finally:
        run(store.db_engine.dispose())


def test_rows_match_the_schema_adk_reads(store, app):
    """The stored row is ADK's: JSON event data with the id, invocation and timestamp columns beside it."""
    session = run(store.create_session(app_name=app, user_id="u"))
    event = user_event(invocation_id="inv-x", content=types.Content(role="user", parts=[types.Part(text="hello")]))
    run(store.append_event(session, event))

    async def raw() -> tuple:
        async with store.db_engine.connect() as conn:
            row = (
                await conn.execute(
                    text("SELECT id, invocation_id, timestamp, event_data FROM events WHERE app_name = :a"), {"a": app}
                )
            ).one()
            session_row = (
                await conn.execute(text("SELECT update_time FROM sessions WHERE app_name = :a"), {"a": app})
            ).one()
            return row, session_row

    row, session_row = run(raw())
    data = row.event_data if isinstance(row.event_data, dict) else json.loads(row.event_data)
    assert (row.id, row.invocation_id) == (event.id, "inv-x")
    assert data == event.model_dump(exclude_none=True, mode="json")
    stored_update_time = session_row.update_time
    if isinstance(stored_update_time, str):
        stored_update_time = datetime.fromisoformat(stored_update_time)
    assert stored_update_time.isoformat(timespec="microseconds") == session._storage_update_marker
