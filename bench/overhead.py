"""What durability costs per run, against the ADK runner alone.

The `support` agent's default script (3 tool calls, then an answer) on the scripted model, on
PostgreSQL, three contenders interleaved block by block:

  (a) ADK runner + InMemorySessionService
  (b) ADK runner + DatabaseSessionService on the same database
  (c) a full Agent Ledger run in-process: row, claim, journal, heartbeat, settle (and whatever
      else the executor does on success)

All three use the same agent, the same tools (which write their outbox / CRM rows), and the
same long-lived event loop. A separate accounting pass counts commits (pg_stat_database),
SQL statements (Django and SQLAlchemy hooks) and where the time goes.

    python bench/overhead.py [--runs 200] [--warmup 20] [--block 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import uuid
from collections import defaultdict

from _benchdb import bench_database
from _common import print_table, save_results, summary

TOOL_CALLS_PER_RUN = 3


def main() -> None:
    args = parse_args()
    os.environ.setdefault("EMAIL_BACKEND", "django.core.mail.backends.locmem.EmailBackend")
    with bench_database('overhead'):
        measure(args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="timed runs per contender")
    parser.add_argument("--warmup", type=int, default=20, help="untimed runs per contender first")
    parser.add_argument("--block", type=int, default=10, help="runs per contender before switching")
    parser.add_argument("--accounting-runs", type=int, default=30)
    args = parser.parse_args()
    if min(args.runs, args.block, args.accounting_runs) < 1 or args.warmup < 0:
        parser.error("--runs, --block and --accounting-runs must be positive, --warmup not negative")
    return args


def measure(args: argparse.Namespace) -> None:

    from django.db import connection
    from google.adk.apps import App
    from google.adk.runners import Runner
    from google.adk.sessions import InMemorySessionService
    from google.genai import types

    from agents.adk import run_coroutine, session_service
    from agents.models import Customer
    from agents.registry import build_agent, get_agent_spec
    from runs import executor, services

    Customer.objects.get_or_create(
        email="jane@example.com", defaults={"name": "Jane Doe", "contact_id": "C-1001", "plan": "pro"}
    )
    spec = get_agent_spec("support")
    message = types.Content(role="user", parts=[types.Part(text="Jane asks where her refund is.")])
    in_memory = InMemorySessionService()

    async def adk_run(sessions) -> None:
        runner = Runner(app=App(name=spec.name, root_agent=build_agent(spec, params={})), session_service=sessions)
        session_id = str(uuid.uuid4())
        await sessions.create_session(app_name=spec.name, user_id="bench", session_id=session_id)
        async for _ in runner.run_async(user_id="bench", session_id=session_id, new_message=message):
            pass
        await runner.close()

    async def database_service():
        return session_service()

    database_sessions = run_coroutine(database_service())

    def run_a() -> None:
        run_coroutine(adk_run(in_memory))

    def run_b() -> None:
        run_coroutine(adk_run(database_sessions))

    def run_c() -> None:
        run = services.start_run(
            agent_name=spec.name, message="Jane asks where her refund is.", owner_id="bench", enqueue=False
        )
        status = executor.execute(run.run_id)
        if status != "success":
            raise SystemExit(f"an Agent Ledger run ended {status}; the benchmark is void")

    contenders = {"a": run_a, "b": run_b, "c": run_c}
    labels = {
        "a": "ADK runner + InMemorySessionService",
        "b": "ADK runner + DatabaseSessionService",
        "c": "Agent Ledger run (in-process)",
    }

    for _ in range(args.warmup):
        for run in contenders.values():
            run()

    timings: dict[str, list[float]] = defaultdict(list)
    done = 0
    while done < args.runs:
        block = min(args.block, args.runs - done)
        for key, run in contenders.items():
            for _ in range(block):
                started = time.perf_counter()
                run()
                timings[key].append((time.perf_counter() - started) * 1000)
        done += block

    accounting = account(contenders, args.accounting_runs, connection, database_sessions)
    stats = {key: summary(values) for key, values in timings.items()}

    print(f"\nPer run, {args.runs} runs per contender (interleaved in blocks of {args.block}), PostgreSQL\n")
    rows = []
    for key in contenders:
        s = stats[key]
        acc = accounting[key]
        rows.append(
            [
                f"({key}) {labels[key]}",
                f"{s['median']:.1f}",
                f"{s['p95']:.1f}",
                f"{s['median'] / TOOL_CALLS_PER_RUN:.1f}",
                f"{acc['commits']:.1f}",
                f"{acc['statements']:.1f}",
            ]
        )
    print_table(["contender", "ms/run p50", "ms/run p95", "ms/tool call", "commits/run", "statements/run"], rows)

    c_over_b = stats["c"]["median"] / stats["b"]["median"]
    c_over_a = stats["c"]["median"] / stats["a"]["median"]
    print(f"\nc/b = {c_over_b:.2f}   (target ≤ 1.10)")
    print(f"c/a = {c_over_a:.2f}   (longer-term goal ≤ 2)")

    print("\nWhere the time of one Agent Ledger run goes (accounting pass, ms per run):")
    breakdown = accounting["c"]["breakdown"]
    print_table(
        ["part", "ms/run", "calls/run"],
        [[part, f"{ms:.2f}", f"{calls:.1f}"] for part, (ms, calls) in breakdown.items()],
    )
    print("\nCommits per run by source (c):", accounting["c"]["commits_by_source"])

    save_results(
        "overhead",
        [
            {"metric": "(a) ms/run, ADK + in-memory sessions", "value": stats["a"]["median"], "unit": "ms"},
            {"metric": "(b) ms/run, ADK + DatabaseSessionService", "value": stats["b"]["median"], "unit": "ms"},
            {"metric": "(c) ms/run, Agent Ledger", "value": stats["c"]["median"], "unit": "ms"},
            {"metric": "c/b", "value": c_over_b, "unit": "ratio", "target": "≤ 1.10"},
            {"metric": "c/a", "value": c_over_a, "unit": "ratio", "target": "≤ 2 (goal)"},
            {"metric": "(b) commits/run", "value": accounting["b"]["commits"], "unit": ""},
            {"metric": "(c) commits/run", "value": accounting["c"]["commits"], "unit": ""},
            {"metric": "(b) statements/run", "value": accounting["b"]["statements"], "unit": ""},
            {"metric": "(c) statements/run", "value": accounting["c"]["statements"], "unit": ""},
        ],
        stats=stats,
        accounting=accounting,
    )


def account(contenders, runs: int, connection, database_sessions) -> dict:
    """Count commits, statements and the time spent per part, outside the timed pass."""
    from django.db.backends.signals import connection_created
    from google.adk.sessions.database_session_service import DatabaseSessionService
    from sqlalchemy import event

    from runs import services

    counters: dict[str, float] = defaultdict(float)

    def django_wrapper(execute, sql, params, many, context):
        counters["statements"] += 1
        counters["django_statements"] += 1
        return execute(sql, params, many, context)

    def install(sender, connection, **kwargs):
        if django_wrapper not in connection.execute_wrappers:
            connection.execute_wrappers.append(django_wrapper)

    from django.db import connections

    connection_created.connect(install)
    for conn in connections.all():
        install(None, conn)
    # Connections that already exist in other threads (the ORM thread of the agent loop).
    from asgiref.sync import SyncToAsync

    SyncToAsync.single_thread_executor.submit(lambda: install(None, connections["default"])).result()

    def on_sqlalchemy_statement(*args, **kwargs):
        counters["statements"] += 1
        counters["adk_statements"] += 1

    def on_sqlalchemy_commit(*args, **kwargs):
        counters["adk_commits"] += 1

    event.listen(database_sessions.db_engine.sync_engine, "before_cursor_execute", on_sqlalchemy_statement)
    event.listen(database_sessions.db_engine.sync_engine, "commit", on_sqlalchemy_commit)

    timers: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])

    def timed_async(owner, name, label):
        original = getattr(owner, name)

        async def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                timers[label][0] += (time.perf_counter() - started) * 1000
                timers[label][1] += 1

        setattr(owner, name, wrapper)
        return original

    def timed_sync(owner, name, label):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers[label][0] += (time.perf_counter() - started) * 1000
                timers[label][1] += 1

        setattr(owner, name, wrapper)
        return original

    results = {}
    for key, run in contenders.items():
        counters.clear()
        timers.clear()
        restore = []
        if key == "c":
            restore = [
                # The journal's rows are written inside append_event's own transaction.
                (DatabaseSessionService, "append_event", timed_async(DatabaseSessionService, "append_event", "session store + journal: append_event")),
                (DatabaseSessionService, "get_session", timed_async(DatabaseSessionService, "get_session", "session store: get_session")),
                (DatabaseSessionService, "create_session", timed_async(DatabaseSessionService, "create_session", "session store: create_session")),
                (services, "start_run", timed_sync(services, "start_run", "ledger: start_run")),
                (services, "claim_run", timed_sync(services, "claim_run", "ledger: claim")),
                (services, "settle_run", timed_sync(services, "settle_run", "ledger: settle")),
            ]
        before = xact_commits(connection)
        started = time.perf_counter()
        for _ in range(runs):
            run()
        total_ms = (time.perf_counter() - started) * 1000
        after = xact_commits(connection)
        for owner, name, original in restore:
            setattr(owner, name, original)
        breakdown = {label: (ms / runs, calls / runs) for label, (ms, calls) in sorted(timers.items())}
        if breakdown:
            measured = sum(ms for ms, _ in breakdown.values())
            breakdown["ADK itself, tools and the rest"] = (total_ms / runs - measured, 0.0)
        results[key] = {
            # Two of the counted commits are this function's own pg_stat reads.
            "commits": (after - before - 1) / runs,
            "statements": counters["statements"] / runs,
            "commits_by_source": {"adk": counters["adk_commits"] / runs},
            "breakdown": breakdown,
        }
    event.remove(database_sessions.db_engine.sync_engine, "before_cursor_execute", on_sqlalchemy_statement)
    event.remove(database_sessions.db_engine.sync_engine, "commit", on_sqlalchemy_commit)
    connection_created.disconnect(install)
    return results


def xact_commits(connection) -> int:
    # An idle backend flushes its statistics within ten seconds (PostgreSQL 15): wait for all.
    time.sleep(11)
    with connection.cursor() as cursor:
        with contextlib.suppress(Exception):
            cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        return cursor.fetchone()[0]


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
