"""Shared plumbing for the benchmarks: a dedicated PostgreSQL database, statistics, results.

Benchmarks are scripts, not tests: each prints its figures and the ratio against its peer
measured in the same run, and stores them under bench/results/ for `make bench` to gather.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
PROJECT_DIR = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432"


def setup_django(database: str, *, fresh: bool = False) -> None:
    """Point Django at a dedicated PostgreSQL database (created if needed) and migrate it."""
    sys.path.insert(0, str(PROJECT_DIR))
    server = os.environ.get("BENCH_POSTGRES", DEFAULT_SERVER).rstrip("/")
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database]).fetchone()
        if exists and fresh:
            admin.execute(f'DROP DATABASE "{database}" WITH (FORCE)')
            exists = None
        if not exists:
            admin.execute(f'CREATE DATABASE "{database}"')
    os.environ["DATABASE_URL"] = f"{server}/{database}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("SCRIPTED_FAULTS_ENABLED", "true")
    os.environ.setdefault("EMAIL_BACKEND", "django.core.mail.backends.locmem.EmailBackend")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def drop_database(database: str) -> None:
    server = os.environ.get("BENCH_POSTGRES", DEFAULT_SERVER).rstrip("/")
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: list[float]) -> dict:
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "mean": statistics.fmean(values),
    }


def machine() -> str:
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    return f"{os.cpu_count()} cores, {cpu}, Python {platform.python_version()}"


def postgres_version() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        return cursor.fetchone()[0]


def save_results(name: str, rows: list[dict], **extra) -> Path:
    """rows: [{"metric", "value", "unit", "peer", "peer_value", "ratio", "target"}]."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_DIR, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    payload = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "commit": commit,
        "rows": rows,
        **extra,
    }
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for index, row in enumerate(cells):
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)))
        if index == 0:
            print("  ".join("-" * w for w in widths))
