"""A throw-away PostgreSQL database for one benchmark: created, migrated, dropped at the end.

The server comes from DATABASE_URL (only its host and credentials are used; `make bench` passes
BENCH_DATABASE_URL), else BENCH_POSTGRES, else the local server on 127.0.0.1:5432. Every
benchmark database is named agentledger_bench_<name> (BENCH_DATABASE_PREFIX changes the prefix),
so nothing else on the server is touched.

With BENCH_TEMPLATE=true each database is copied from <prefix>template, migrated once by
`python bench/_benchdb.py template` (and dropped by `... drop-template`): the smoke run of
every benchmark (`make bench-smoke`) then pays for the migrations once instead of per script.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/postgres"
PREFIX = os.environ.get("BENCH_DATABASE_PREFIX") or "agentledger_bench_"
if "bench" not in PREFIX:
    sys.exit(f"BENCH_DATABASE_PREFIX={PREFIX!r}: benchmark database names must say 'bench'")
TEMPLATE = f"{PREFIX}template"


def database_url(database: str) -> str:
    """The URL of `database` on the benchmark server."""
    url = os.environ.get("DATABASE_URL") or os.environ.get("BENCH_POSTGRES") or DEFAULT_SERVER
    if not url.startswith(("postgres://", "postgresql://")):
        sys.exit(f"DATABASE_URL={url!r}: the benchmarks need PostgreSQL, e.g. {DEFAULT_SERVER}")
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


def _admin(sql: str, params: list | None = None):
    import psycopg

    with psycopg.connect(database_url("postgres"), autocommit=True) as conn:
        return conn.execute(sql, params).fetchall() if params is not None else conn.execute(sql)


def _checked(database: str) -> str:
    # Dropping is WITH (FORCE): refuse any name that is not a benchmark's own.
    if not database.startswith(PREFIX):
        raise ValueError(f"{database!r} is not a benchmark database (names start with {PREFIX!r})")
    return database


def drop_database(database: str) -> None:
    _admin(f'DROP DATABASE IF EXISTS "{_checked(database)}" WITH (FORCE)')


def create_database(database: str, *, fresh: bool = True) -> bool:
    """Create `database` (dropping it first if `fresh`); False if it already existed and was kept."""
    if fresh:
        drop_database(database)
    elif _admin("SELECT 1 FROM pg_database WHERE datname = %s", [_checked(database)]):
        return False
    if os.environ.get("BENCH_TEMPLATE", "").lower() in ("1", "true", "yes", "on"):
        _admin(f'CREATE DATABASE "{_checked(database)}" TEMPLATE "{TEMPLATE}"')
    else:
        _admin(f'CREATE DATABASE "{_checked(database)}"')
    return True


def make_template() -> None:
    """<prefix>template, created anew and migrated in a child process (a template takes no open
    connection when it is copied)."""
    drop_database(TEMPLATE)
    _admin(f'CREATE DATABASE "{TEMPLATE}"')
    started = time.monotonic()
    env = {**os.environ, "DATABASE_URL": database_url(TEMPLATE), "DJANGO_SETTINGS_MODULE": "config.settings"}
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
    print(f"database {TEMPLATE}: migrated in {time.monotonic() - started:.1f} s", flush=True)


def use_database(database: str) -> None:
    """Point this process's Django (and the child processes it starts) at `database`, migrated."""
    os.environ["DATABASE_URL"] = database_url(database)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("RUN_INPUTS_DIR", tempfile.mkdtemp(prefix="bench-inputs-"))
    # A benchmark's runs send their emails nowhere: in memory, in this process.
    os.environ.setdefault("EMAIL_BACKEND", "django.core.mail.backends.locmem.EmailBackend")
    import django

    django.setup()
    from django.core.management import call_command

    started = time.monotonic()
    call_command("migrate", verbosity=0)
    # Recorded now: results are often saved after the database is gone.
    os.environ["BENCH_POSTGRES_VERSION"] = postgres_version()
    print(f"database {database}: migrated in {time.monotonic() - started:.1f} s", flush=True)


@contextlib.contextmanager
def bench_database(name: str, *, fresh: bool = True, keep: bool = False):
    """agentledger_bench_<name>, created and migrated, Django set up on it; dropped at the end.

    fresh=False reuses the database if it exists (for data that is slow to load); keep=True
    leaves it in place at the end for inspection or the next run.
    """
    database = _checked(f"{PREFIX}{name}")
    created = create_database(database, fresh=fresh)
    print(f"database {database}: {'created' if created else 'reused'}", flush=True)
    try:
        use_database(database)
        yield database
    finally:
        try:
            if "django" in sys.modules:
                from django.db import connections

                if "agents.adk" in sys.modules:
                    from agents.adk import release_process_resources

                    release_process_resources()
                connections.close_all()
        finally:
            if keep:
                print(f"database {database}: kept")
            else:
                drop_database(database)
                print(f"database {database}: dropped")


def postgres_version() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        return cursor.fetchone()[0]


@contextlib.contextmanager
def timed(label: str, into: dict | None = None):
    started = time.perf_counter()
    yield
    elapsed = time.perf_counter() - started
    if into is not None:
        into[label] = elapsed
    print(f"  {label}: {elapsed:.3f} s")


if __name__ == "__main__":
    commands = {"template": make_template, "drop-template": lambda: drop_database(TEMPLATE)}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(commands)}")
    commands[sys.argv[1]]()
