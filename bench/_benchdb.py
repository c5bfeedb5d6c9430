"""A throw-away PostgreSQL database for one benchmark: created, migrated, dropped at the end.

DATABASE_URL must point at a PostgreSQL server; only its server and credentials are used.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _server_url(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


@contextlib.contextmanager
def bench_database(name: str):
    import psycopg

    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        sys.exit("Set DATABASE_URL to a PostgreSQL URL, e.g. postgres://postgres@127.0.0.1:5432/postgres")
    database = f"agentledger_bench_{name}"
    admin_url = _server_url(url, "postgres")

    def admin(sql: str) -> None:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(sql)

    admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    admin(f'CREATE DATABASE "{database}"')
    os.environ["DATABASE_URL"] = _server_url(url, database)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("RUN_INPUTS_DIR", tempfile.mkdtemp(prefix="bench-inputs-"))
    try:
        import django

        django.setup()
        from django.core.management import call_command

        started = time.monotonic()
        call_command("migrate", verbosity=0)
        print(f"database {database}: created and migrated in {time.monotonic() - started:.1f} s")
        yield database
    finally:
        try:
            from django.db import connections

            from agents.adk import release_process_resources

            release_process_resources()
            connections.close_all()
        finally:
            admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            print(f"database {database}: dropped")


@contextlib.contextmanager
def timed(label: str, into: dict | None = None):
    started = time.perf_counter()
    yield
    elapsed = time.perf_counter() - started
    if into is not None:
        into[label] = elapsed
    print(f"  {label}: {elapsed:.3f} s")
