"""Many runs in flight per worker: real `runworker` processes against the ADK runner alone.

Every run is the `support` agent on the scripted model: three tool calls, then an answer, each
of the four model calls taking `--latency` seconds of "provider time" (the scripted model's
`latency` step, an asyncio.sleep). On PostgreSQL, in the same invocation:

  (new) `manage.py runworker` with default settings (RUN_WORKER_PROCESSES × RUN_CONCURRENCY runs in flight)
  (a)   ADK Runner + InMemorySessionService, every run at once with asyncio.gather, one process:
        the ideal, with no durability at all
  (b)   ADK Runner + ADK's DatabaseSessionService, the same way, its pool as large as the whole
        cluster's (RUN_WORKER_PROCESSES × (ADK_DB_POOL_SIZE + ADK_DB_MAX_OVERFLOW)): with ADK's default
        pool (5 + 10, 30 s timeout) 500 runs at once fail waiting for a connection
  (c)   the same cluster with RUN_CONCURRENCY=1: one run at a time per worker process, as before
        (fewer runs: at one run per --latency × 4 s per process, 500 would take long)
  (d)   the same cluster with a larger ADK pool (`--large-pool` per process, no overflow): whether
        runs wait for pooled connections

For the workers: runs/s from the commit of the whole backlog until the last run settles, runs in
flight (sampled), run duration (claim to settle), the workers' RSS growth per run in flight, their
CPU use and PostgreSQL's (as shares of all cores; PostgreSQL's counts the backends that exited
meanwhile, through the postmaster's children's CPU), the whole machine's busy share (/proc/stat),
the database connections open during the run, and the new connections per run with the time
backends of this database spent executing statements (pg_stat_database `sessions`, `active_time`).

    python bench/concurrency.py [--runs 500] [--latency 1] [--serial-runs 20] [--large-pool 35]

`--wire` measures the same cluster with every model call over HTTP: the real google-genai client
(GOOGLE_API_KEY set, AGENT_MODEL=gemini-2.5-flash) against `tests/fake_gemini.py`, which answers
the support agent's conversation after `--latency` seconds; the peer is the scripted cluster
measured in the same invocation.

    python bench/concurrency.py --wire [--runs 100] [--latency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
import uuid
from pathlib import Path

from _benchdb import bench_database
from _common import PROJECT_DIR, print_table, row, save_results, start_runworker, stop_runworker, summary

TOOLS = ("lookup_customer", "send_email", "update_crm")
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def script(latency: float) -> list[dict]:
    return [
        {"call": "lookup_customer", "args": {"email": "jane@example.com"}, "latency": latency},
        {"call": "send_email", "args": {"to": "jane@example.com", "subject": "Refund", "body": "On its way."},
         "latency": latency},
        {"call": "update_crm", "args": {"contact_id": "C-1001", "note": "Refund sent."}, "latency": latency},
        {"say": "Done.", "latency": latency},
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--latency", type=float, default=1.0, help="seconds per model call")
    parser.add_argument("--serial-runs", type=int, default=20, help="runs for (c), RUN_CONCURRENCY=1")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--large-pool", type=int, default=35,
                        help="ADK pool per process for (d), at most RUN_CONCURRENCY (mind max_connections)")
    parser.add_argument("--wire", action="store_true", help="model calls over HTTP against a local fake Gemini")
    args = parser.parse_args()
    if min(args.runs, args.serial_runs) < 1 or args.latency < 0 or args.warmup < 0:
        parser.error("--runs and --serial-runs must be positive, --latency and --warmup not negative")
    return args


def main() -> None:
    args = parse_args()
    os.environ.setdefault("SCRIPTS_FROM_USERS_ALLOWED", "true")
    os.environ.setdefault("MAX_RUNS_IN_FLIGHT_PER_USER", "0")
    # Its own database in --wire mode: a plain run of this benchmark may be using the other.
    with bench_database("concurrency_wire" if args.wire else "concurrency"):
        measure_wire(args) if args.wire else measure(args)


def measure_wire(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(PROJECT_DIR))
    from agents.models import Customer
    from tests.fake_gemini import FakeGemini, support_conversation

    Customer.objects.get_or_create(
        email="jane@example.com", defaults={"name": "Jane Doe", "contact_id": "C-1001", "plan": "pro"}
    )
    print(f"{args.runs} runs, 4 model calls each, {args.latency:g} s per model call; scripted, then over HTTP",
          flush=True)
    results = {"scripted": _said("scripted", cluster_pass(count=args.runs, latency=args.latency, warmup=args.warmup))}
    with FakeGemini(responder=support_conversation, latency=args.latency) as fake:
        wire = cluster_pass(count=args.runs, latency=args.latency, warmup=args.warmup,
                            AGENT_MODEL="gemini-2.5-flash", **fake.env())
        wire["provider_in_flight_max"] = fake.max_in_flight
        wire["requests"] = len(fake.requests)
    results["wire"] = _said("wire", wire)
    print()
    print_table(
        ["model", "runs", "runs/s", "in flight max", "run s p50", "run s p95", "CPU share", "at the provider max"],
        [
            [key, r["runs"], f"{r['runs_per_s']:.1f}", r["in_flight_max"], f"{r['duration']['median']:.2f}",
             f"{r['duration']['p95']:.2f}", f"{r['cpu_share']:.0%}", r.get("provider_in_flight_max", "-")]
            for key, r in results.items()
        ],
    )
    ratio = wire["runs_per_s"] / results["scripted"]["runs_per_s"]
    print(f"\nwire/scripted throughput = {ratio:.2f}; {wire['requests']} HTTP model calls")
    save_results(
        "concurrency_wire",
        [
            row("runs/s, model calls over HTTP", round(wire["runs_per_s"], 1), "runs/s",
                peer="scripted model, same cluster", peer_value=round(results["scripted"]["runs_per_s"], 1)),
            row("run duration p95, over HTTP", round(wire["duration"]["p95"], 2), "s",
                peer="scripted model", peer_value=round(results["scripted"]["duration"]["p95"], 2)),
            row("model calls in flight at the provider, max", wire["provider_in_flight_max"], "calls"),
        ],
        runs=args.runs, latency_s=args.latency, contenders=results,
    )


# --- The cluster's processes, read from /proc ----------------------------------------------------


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _rss_and_cpu(root: int) -> tuple[int, float]:
    rss, cpu = 0, 0.0
    for pid in _tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu += (int(fields[11]) + int(fields[12])) / TICKS
        rss += int(fields[21]) * PAGE
    return rss, cpu


def _machine_cpu() -> tuple[int, int]:
    """(busy, all) jiffies of every core since boot, from /proc/stat: the whole machine's load."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def _postgres_cpu() -> float:
    """CPU seconds of every PostgreSQL process on this machine (the server runs here), the exited
    ones included: a backend that ends is reaped by the postmaster, whose `cutime`/`cstime` then
    hold its CPU. On a shared machine this counts every database's backends."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            head, _, rest = (entry / "stat").read_text().rpartition(")")
        except OSError:
            continue
        if head.endswith("(postgres"):
            fields = rest.split()
            total += (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / TICKS
    return total


def database_activity() -> tuple[int, float]:
    """(sessions opened, ms spent executing statements) of this database since the stats reset
    (pg_stat_database, PostgreSQL 14+): exited backends included, other databases not."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT sessions, active_time FROM pg_stat_database WHERE datname = current_database()")
        sessions, active = cursor.fetchone()
    return int(sessions), float(active)


def _start_runs(count: int, latency: float) -> list:
    from django.db import transaction

    from runs.ledger import lifecycle
    from runs.services import run as services

    # The whole backlog commits at once (and wakes the workers once): the clock starts with it there.
    with transaction.atomic():
        runs = [
            services.start_run(agent_name="support", message=f"Refund {i}", owner_id="bench",
                               params={"script": script(latency)}, enqueue=False)
            for i in range(count)
        ]
        lifecycle.announce_run(runs[-1].run_id)
    return runs


def cluster_pass(*, count: int, latency: float, warmup: int, **env: str) -> dict:
    from django.db import connection

    from runs.models.ledger import AgentRun, RunStatus

    cluster = start_runworker(**env)
    try:
        if warmup:
            ids = [r.run_id for r in _start_runs(warmup, 0)]
            _wait_settled(ids, timeout=300)
        rss_before, cpu_before = _rss_and_cpu(cluster.pid)
        postgres_before = _postgres_cpu()
        machine_before = _machine_cpu()
        sessions_before, active_before = database_activity()
        ids = [r.run_id for r in _start_runs(count, latency)]
        started = time.monotonic()
        in_flight: list[int] = []
        connections: list[int] = []
        rss_peak = rss_before
        deadline = started + max(600, count * latency * 4 * 2)
        with connection.cursor() as cursor:
            while True:
                cursor.execute(
                    "SELECT count(*) FILTER (WHERE status = 'running'), count(*) FILTER (WHERE status IN ('queued','running'))"
                    " FROM agent_runs WHERE run_id = ANY(%s)", [ids],
                )
                running, unsettled = cursor.fetchone()
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
                connections.append(cursor.fetchone()[0] - 1)  # not this benchmark's own
                in_flight.append(running)
                rss_peak = max(rss_peak, _rss_and_cpu(cluster.pid)[0])
                if not unsettled:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"{unsettled} run(s) did not settle in time")
                time.sleep(0.25)
        rss_after, cpu_after = _rss_and_cpu(cluster.pid)
        postgres_cpu = _postgres_cpu() - postgres_before
        machine_after = _machine_cpu()
        sessions_after, active_after = database_activity()
    finally:
        stop_runworker(cluster, drain_seconds=90)
    runs = list(AgentRun.objects.filter(pk__in=ids).values("status", "created_at", "started_at", "finished_at"))
    failed = [r for r in runs if r["status"] != RunStatus.SUCCESS]
    if failed:
        raise SystemExit(f"{len(failed)} run(s) did not succeed; the benchmark is void")
    first = min(r["created_at"] for r in runs)
    last = max(r["finished_at"] for r in runs)
    wall = (last - first).total_seconds()
    wall = min(wall, time.monotonic() - started)  # the backlog was complete at `started`
    durations = [(r["finished_at"] - r["started_at"]).total_seconds() for r in runs]
    peak = max(in_flight)
    return {
        "runs": count,
        "wall_s": wall,
        "runs_per_s": count / wall,
        "in_flight_p50": sorted(in_flight)[len(in_flight) // 2],
        "in_flight_max": peak,
        "duration": summary(durations),
        "rss_per_run_kib": (rss_peak - rss_before) / max(1, peak) / 1024,
        "rss_peak_mib": rss_peak / 2**20,
        "cpu_s": cpu_after - cpu_before,
        "cpu_share": (cpu_after - cpu_before) / wall / (os.cpu_count() or 1),
        "postgres_cpu_share": postgres_cpu / wall / (os.cpu_count() or 1),
        # Everything the machine did meanwhile (the cluster, PostgreSQL, this script's polling,
        # the kernel): near 100 % the cluster is bound by the cores, not by a pool or a lock.
        "machine_cpu_busy": (machine_after[0] - machine_before[0]) / max(1, machine_after[1] - machine_before[1]),
        "db_connections_max": max(connections),
        # This script's own polling connection is one session for the whole pass.
        "new_connections_per_run": (sessions_after - sessions_before) / count,
        "db_active_ms_per_run": (active_after - active_before) / count,
    }


def _wait_settled(ids: list, *, timeout: float) -> None:
    from runs.models.ledger import AgentRun, RunStatus

    deadline = time.monotonic() + timeout
    while AgentRun.objects.filter(pk__in=ids, status__in=[RunStatus.QUEUED, RunStatus.RUNNING]).exists():
        if time.monotonic() > deadline:
            raise SystemExit("the warm-up runs did not settle")
        time.sleep(0.2)


# --- The ADK runner alone, every run at once in this process -------------------------------------


def gather_pass(*, count: int, latency: float, sessions_factory) -> dict:
    from google.adk.apps import App
    from google.adk.runners import Runner
    from google.genai import types

    from agents.adk import run_coroutine
    from agents.registry import build_agent, get_agent_spec

    spec = get_agent_spec("support")
    message = types.Content(role="user", parts=[types.Part(text="Jane asks where her refund is.")])

    async def one(sessions) -> float:
        runner = Runner(
            app=App(name=spec.name, root_agent=build_agent(spec, params={"script": script(latency)})),
            session_service=sessions,
        )
        began = time.monotonic()
        session_id = str(uuid.uuid4())
        await sessions.create_session(app_name=spec.name, user_id="bench", session_id=session_id)
        async for _ in runner.run_async(user_id="bench", session_id=session_id, new_message=message):
            pass
        await runner.close()
        return time.monotonic() - began

    async def everything() -> tuple[float, list[float]]:
        sessions = sessions_factory()
        await one(sessions)  # tables, pool and imports warm
        began = time.monotonic()
        durations = await asyncio.gather(*(one(sessions) for _ in range(count)))
        wall = time.monotonic() - began
        engine = getattr(sessions, "db_engine", None)
        if engine is not None:
            await engine.dispose()
        return wall, list(durations)

    cpu_before, postgres_before = time.process_time(), _postgres_cpu()
    wall, durations = run_coroutine(everything())
    cpu, postgres_cpu = time.process_time() - cpu_before, _postgres_cpu() - postgres_before
    return {
        "runs": count, "wall_s": wall, "runs_per_s": count / wall, "in_flight_max": count,
        "duration": summary(durations), "cpu_s": cpu, "cpu_share": cpu / wall / (os.cpu_count() or 1),
        "postgres_cpu_share": postgres_cpu / wall / (os.cpu_count() or 1),
    }


def measure(args: argparse.Namespace) -> None:
    from django.conf import settings
    from google.adk.sessions import InMemorySessionService
    from google.adk.sessions.database_session_service import DatabaseSessionService
    from sqlalchemy.ext.asyncio import create_async_engine

    from agents.adk import adk_database_url
    from agents.models import Customer

    Customer.objects.get_or_create(
        email="jane@example.com", defaults={"name": "Jane Doe", "contact_id": "C-1001", "plan": "pro"}
    )
    pool = settings.ADK_DB_POOL_SIZE + settings.ADK_DB_MAX_OVERFLOW

    def stock_service() -> DatabaseSessionService:
        engine = create_async_engine(
            adk_database_url(), pool_size=settings.RUN_WORKER_PROCESSES * settings.ADK_DB_POOL_SIZE,
            max_overflow=settings.RUN_WORKER_PROCESSES * settings.ADK_DB_MAX_OVERFLOW, pool_timeout=300,
        )
        return DatabaseSessionService(db_engine=engine)

    print(f"{args.runs} runs, 3 tool calls and 4 model calls each, {args.latency:g} s per model call; "
          f"RUN_WORKER_PROCESSES={settings.RUN_WORKER_PROCESSES}, RUN_CONCURRENCY={settings.RUN_CONCURRENCY}, "
          f"ADK pool {settings.ADK_DB_POOL_SIZE}+{settings.ADK_DB_MAX_OVERFLOW} = {pool} per process", flush=True)

    results: dict[str, dict] = {}
    print("(new) runworker, default settings …", flush=True)
    results["new"] = _said("new", cluster_pass(count=args.runs, latency=args.latency, warmup=args.warmup))
    print("(a) ADK Runner + InMemorySessionService, asyncio.gather …", flush=True)
    results["a"] = _said("a", gather_pass(count=args.runs, latency=args.latency, sessions_factory=InMemorySessionService))
    print("(b) ADK Runner + DatabaseSessionService, asyncio.gather …", flush=True)
    results["b"] = _said("b", gather_pass(count=args.runs, latency=args.latency, sessions_factory=stock_service))
    # Every run of a process can hold a pooled connection at once (max_connections allowing):
    # if the default pool were the bottleneck, this pass would be faster.
    large_pool = max(pool, min(settings.RUN_CONCURRENCY, args.large_pool))
    print(f"(d) runworker, ADK pool {large_pool}+0 per process …", flush=True)
    results["d"] = _said("d", cluster_pass(count=args.runs, latency=args.latency, warmup=args.warmup,
                                ADK_DB_POOL_SIZE=str(large_pool), ADK_DB_MAX_OVERFLOW="0"))
    results["d"]["pool"] = large_pool
    print(f"(c) runworker, RUN_CONCURRENCY=1, {args.serial_runs} runs …", flush=True)
    results["c"] = _said("c", cluster_pass(count=args.serial_runs, latency=args.latency, warmup=2, RUN_CONCURRENCY="1",
                                ADK_DB_POOL_SIZE="3", ADK_DB_MAX_OVERFLOW="2"))
    report(args, results)


def _said(key: str, result: dict) -> dict:
    print(f"  ({key}) {result['runs_per_s']:.1f} runs/s, run p50 {result['duration']['median']:.2f} s", flush=True)
    return result


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    labels = {
        "new": "(new) runworker, default settings",
        "a": "(a) ADK Runner + InMemorySessionService, gather",
        "b": "(b) ADK Runner + DatabaseSessionService, gather",
        "c": "(c) runworker, RUN_CONCURRENCY=1",
        "d": f"(d) runworker, ADK pool {results['d']['pool']}+0 per process",
    }
    print()
    print_table(
        ["contender", "runs", "runs/s", "in flight p50/max", "run s p50", "run s p95", "CPU share", "PostgreSQL CPU",
         "machine CPU busy", "RSS KiB/run in flight", "DB connections", "new conn/run", "DB active ms/run"],
        [
            [
                labels[key], r["runs"], f"{r['runs_per_s']:.1f}",
                f"{r.get('in_flight_p50', '-')}/{r['in_flight_max']}",
                f"{r['duration']['median']:.2f}", f"{r['duration']['p95']:.2f}", f"{r['cpu_share']:.0%}",
                f"{r['postgres_cpu_share']:.0%}",
                f"{r['machine_cpu_busy']:.0%}" if "machine_cpu_busy" in r else "-",
                f"{r['rss_per_run_kib']:.0f}" if "rss_per_run_kib" in r else "-",
                r.get("db_connections_max", "-"),
                f"{r['new_connections_per_run']:.2f}" if "new_connections_per_run" in r else "-",
                f"{r['db_active_ms_per_run']:.1f}" if "db_active_ms_per_run" in r else "-",
            ]
            for key, r in results.items()
        ],
    )
    new, a, b, c = (results[k] for k in ("new", "a", "b", "c"))
    share_of_ideal = new["runs_per_s"] / a["runs_per_s"]
    speedup = new["runs_per_s"] / c["runs_per_s"]
    print(f"\nnew/a throughput = {share_of_ideal:.2f} (target ≥ 0.60); new/b = {new['runs_per_s'] / b['runs_per_s']:.2f}")
    print(f"runs in flight, max = {new['in_flight_max']} (target ≥ 200)")
    print(f"(c)/(new) throughput = {c['runs_per_s'] / new['runs_per_s']:.3f} ({speedup:.0f}× more with the pool)")
    save_results(
        "concurrency",
        [
            row("runs/s, runworker default settings", round(new["runs_per_s"], 1), "runs/s",
                peer="ADK Runner + InMemorySessionService, gather", peer_value=round(a["runs_per_s"], 1)),
            row("throughput share of the in-memory ideal", round(share_of_ideal, 2), "×", target="≥ 0.60 (moonshot 0.8)"),
            row("runs in flight, max", new["in_flight_max"], "runs", target="≥ 200"),
            row("run duration p95, runworker", round(new["duration"]["p95"], 2), "s",
                peer="ADK Runner + DatabaseSessionService, gather", peer_value=round(b["duration"]["p95"], 2)),
            row("throughput with RUN_CONCURRENCY=1", round(c["runs_per_s"], 2), "runs/s",
                peer="default RUN_CONCURRENCY", peer_value=round(new["runs_per_s"], 1)),
            row(f"runs/s, ADK pool {results['d']['pool']}+0 per process", round(results["d"]["runs_per_s"], 1),
                "runs/s", peer="default pool", peer_value=round(new["runs_per_s"], 1)),
            row("machine CPU busy, runworker default settings", round(100 * new["machine_cpu_busy"]), "%"),
            row("new PostgreSQL connections per run, runworker", round(new["new_connections_per_run"], 2), "connections"),
            row("PostgreSQL statement time per run (pg_stat_database active_time)",
                round(new["db_active_ms_per_run"], 1), "ms"),
        ],
        runs=args.runs, latency_s=args.latency, contenders=results,
    )


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
