"""ADK's session service on Django's own database.

The service is `agents.session_store.SessionStore`: ADK's DatabaseSessionService (same tables,
same contract) whose event append is one compare-and-set transaction.

The URL is derived from the *active* Django connection each time a service is built, so the
test database is used under tests and a deployment configures one variable, DATABASE_URL.

An async engine belongs to the event loop that created it, so services are cached per loop:
worker processes run every agent on one long-lived loop thread (see `run_coroutine`), and the
ASGI server's loop gets its own service for streamed chat turns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from asgiref.sync import SyncToAsync
from django.conf import settings
from django.db import connections
from sqlalchemy import event, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from agents.session_store import SessionStore

T = TypeVar("T")

EVENTS_TIMESTAMP_INDEX = "idx_events_timestamp"


def adk_database_url(alias: str = "default") -> URL:
    """The SQLAlchemy async URL of the database Django is using right now."""
    settings_dict = connections[alias].settings_dict
    vendor = connections[alias].vendor
    if vendor == "sqlite":
        return URL.create("sqlite+aiosqlite", database=str(settings_dict["NAME"]))
    if vendor == "postgresql":
        return URL.create(
            "postgresql+psycopg",
            username=settings_dict.get("USER") or None,
            password=settings_dict.get("PASSWORD") or None,
            host=settings_dict.get("HOST") or None,
            port=int(settings_dict["PORT"]) if settings_dict.get("PORT") else None,
            database=settings_dict["NAME"],
        )
    raise RuntimeError(f"ADK sessions are not supported on the {vendor!r} database backend.")


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # The same pragmas as Django's connections: ADK, the web server and the worker share a file.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute(f"PRAGMA busy_timeout={settings.SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def create_adk_engine(*, pooled: bool = True) -> AsyncEngine:
    url = adk_database_url()
    kwargs: dict[str, Any] = {}
    if pooled:
        kwargs.update(
            pool_size=settings.ADK_DB_POOL_SIZE,
            max_overflow=settings.ADK_DB_MAX_OVERFLOW,
            pool_recycle=settings.ADK_DB_POOL_RECYCLE_SECONDS,
            # A ping per checkout is a round trip per event; SessionStore retries once instead
            # when a pooled connection turns out to be dead.
            pool_pre_ping=False,
        )
    else:
        kwargs["poolclass"] = NullPool
    if url.get_backend_name() == "sqlite":
        kwargs["connect_args"] = {"timeout": settings.SQLITE_BUSY_TIMEOUT_MS / 1000}
    engine = create_async_engine(url, **kwargs)
    if url.get_backend_name() == "sqlite":
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


def create_session_service(*, pooled: bool = True) -> SessionStore:
    return SessionStore(db_engine=create_adk_engine(pooled=pooled), lagging_commits=settings.EVENT_COMMITS_MAY_LAG)


_services: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, SessionStore]]
_services = weakref.WeakKeyDictionary()
_services_lock = threading.Lock()


def session_service() -> SessionStore:
    """The session service for the running loop and the active database."""
    loop = asyncio.get_running_loop()
    key = adk_database_url().render_as_string(hide_password=False)
    with _services_lock:
        per_loop = _services.setdefault(loop, {})
        service = per_loop.get(key)
        if service is None:
            service = per_loop[key] = create_session_service()
    return service


async def close_session_services_for_loop() -> None:
    loop = asyncio.get_running_loop()
    with _services_lock:
        per_loop = _services.pop(loop, {})
    for service in per_loop.values():
        await service.db_engine.dispose()


def ensure_adk_tables() -> None:
    """Create ADK's tables (and record their schema version) if they do not exist yet."""

    async def prepare() -> None:
        service = create_session_service(pooled=False)
        try:
            await service.prepare_tables()
            # ADK's only events index leads with app_name; the retention purge selects by age.
            async with service.db_engine.begin() as conn:
                await conn.execute(text(f"CREATE INDEX IF NOT EXISTS {EVENTS_TIMESTAMP_INDEX} ON events (\"timestamp\")"))
        finally:
            await service.db_engine.dispose()

    run_coroutine(prepare())


# --- One long-lived event loop per process -----------------------------------------------------

_loop_state: dict[str, Any] = {"pid": None, "loop": None}
_loop_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    with _loop_lock:
        if _loop_state["pid"] != os.getpid() or _loop_state["loop"] is None:
            # After a fork the parent's loop thread does not exist in the child: start anew.
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="adk-loop", daemon=True)
            thread.start()
            _loop_state.update(pid=os.getpid(), loop=loop)
        return _loop_state["loop"]


def submit_coroutine(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start `coro` on this process's agent loop without waiting: many runs share the loop."""
    return asyncio.run_coroutine_threadsafe(coro, _background_loop())


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on this process's agent loop and wait for its result.

    Reusing one loop keeps ADK's connection pool warm across runs instead of paying for a new
    engine and new connections on every run.
    """
    return submit_coroutine(coro).result()


def _orm_thread_call(func: Any) -> None:
    # Django's async ORM (and sync_to_async) runs queries made from the agent loop on asgiref's
    # single shared thread, which keeps its own database connection.

    SyncToAsync.single_thread_executor.submit(func).result()


def drop_unusable_connection() -> None:
    """Close this thread's database connection if it is broken; keep a healthy one.

    close_old_connections() would also close a healthy connection when CONN_MAX_AGE is 0,
    making every run pay for a new connection.
    """

    conn = connections["default"]
    if conn.connection is not None and (conn.errors_occurred or not conn.is_usable()):
        conn.close()


def refresh_orm_thread_connections() -> None:
    """Before a run: replace the ORM thread's connection if it broke since the last run."""
    _orm_thread_call(drop_unusable_connection)


def release_process_resources() -> None:
    """Dispose every pooled ADK engine of this process and the ORM thread's connections.

    Needed before a database can be dropped (test teardown) and on orderly shutdown.
    """

    with _loop_lock:
        loop = _loop_state["loop"] if _loop_state["pid"] == os.getpid() else None
    if loop is not None:
        asyncio.run_coroutine_threadsafe(close_session_services_for_loop(), loop).result()
    _orm_thread_call(connections.close_all)
