"""The ledger as a queue: how fast worker processes claim and settle runs, and how soon a run is claimed.

Two figures a reader can plan with, on one PostgreSQL:

- **Claim rate**: runs claimed and settled per second by 1, 2, 4 and 8 worker processes
  (`manage.py runworker --processes N`) draining a backlog committed at once. The agent does
  next to nothing: the scripted `support` agent answering at once (one model turn, no tool,
  no latency), so the figure is the ledger's own cost per run (claim, session, events, settle),
  not an agent's.
- **Start → claim latency**: runs started one at a time (a pause between them), each claimed by
  an idle worker; the time from the run's commit (`created_at`) to its claim (`started_at`),
  with NOTIFY (the default) and with polling only (`RUN_LISTEN=false`, RUN_POLL_SECONDS apart).

Beside the rate, each pass counts the new PostgreSQL connections per run and the time this
database's backends spent executing statements per run (pg_stat_database `sessions`,
`active_time`, exited backends included).

    python bench/claim_rate.py [--runs 400] [--processes 1,2,4,8] [--latency-runs 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _benchdb import bench_database
from _common import print_table, row, save_results, start_runworker, stop_runworker, summary

NO_OP = [{"say": "ok"}]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=400, help="backlog per claim-rate pass")
    parser.add_argument("--processes", default="1,2,4,8", help="worker process counts, comma-separated")
    parser.add_argument("--latency-runs", type=int, default=40, help="runs per latency pass")
    parser.add_argument("--poll", type=float, default=2.0, help="RUN_POLL_SECONDS of the polling-only pass")
    args = parser.parse_args()
    try:
        args.process_counts = [int(part) for part in args.processes.split(",") if part.strip()]
    except ValueError:
        parser.error("--processes: whole numbers separated by commas, e.g. 1,2,4,8")
    if args.runs < 1 or args.latency_runs < 1 or not args.process_counts or min(args.process_counts) < 1:
        parser.error("--runs, --latency-runs and every process count must be positive")
    return args


def activity() -> tuple[int, float]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT sessions, active_time FROM pg_stat_database WHERE datname = current_database()")
        sessions, active = cursor.fetchone()
    return int(sessions), float(active)


def wait_idle_workers(processes: int, *, timeout: float = 120) -> None:
    """Until `processes` workers hold their lock (they are up and listening)."""
    from runs.ledger import presence

    deadline = time.monotonic() + timeout
    while (presence.alive_workers() or 0) < processes:
        if time.monotonic() > deadline:
            raise SystemExit(f"{processes} worker process(es) did not start")
        time.sleep(0.2)


def _settled(ids: list, *, timeout: float) -> None:
    from runs.models.ledger import AgentRun, RunStatus

    deadline = time.monotonic() + timeout
    while AgentRun.objects.filter(pk__in=ids, status__in=[RunStatus.QUEUED, RunStatus.RUNNING]).exists():
        if time.monotonic() > deadline:
            raise SystemExit("runs did not settle in time")
        time.sleep(0.1)


def backlog(count: int) -> list:
    from django.db import transaction

    from runs.ledger import lifecycle
    from runs.services import run as services

    with transaction.atomic():
        runs = [
            services.start_run(agent_name="support", message=f"ping {i}", owner_id="bench",
                               params={"script": NO_OP}, enqueue=False)
            for i in range(count)
        ]
        lifecycle.announce_run(runs[-1].run_id)
    return [run.run_id for run in runs]


def rate_pass(processes: int, count: int) -> dict:
    from runs.models.ledger import AgentRun, RunStatus

    workers = start_runworker(RUN_WORKER_PROCESSES=str(processes), LOG_LEVEL="WARNING")
    try:
        wait_idle_workers(processes)
        _settled(backlog(min(20, count)), timeout=300)  # imports, pools and tables warm
        sessions_before, active_before = activity()
        began = time.monotonic()
        ids = backlog(count)
        _settled(ids, timeout=max(600, count))
        wall = time.monotonic() - began
        sessions_after, active_after = activity()
    finally:
        stop_runworker(workers)
    failed = AgentRun.objects.filter(pk__in=ids).exclude(status=RunStatus.SUCCESS).count()
    if failed:
        raise SystemExit(f"{failed} run(s) did not succeed; the benchmark is void")
    return {
        "processes": processes, "runs": count, "wall_s": wall, "runs_per_s": count / wall,
        "new_connections_per_run": (sessions_after - sessions_before) / count,
        "db_active_ms_per_run": (active_after - active_before) / count,
    }


def latency_pass(count: int, **env: str) -> dict:
    from runs.models.ledger import AgentRun
    from runs.services import run as services

    workers = start_runworker(RUN_WORKER_PROCESSES="1", LOG_LEVEL="WARNING", **env)
    try:
        if env.get("RUN_LISTEN") == "false":
            time.sleep(5)  # no lock to wait for: the process is up after Django's start
        else:
            wait_idle_workers(1)
        _settled(backlog(5), timeout=300)
        ids = []
        for i in range(count):
            ids.append(services.start_run(agent_name="support", message=f"ping {i}", owner_id="bench",
                                          params={"script": NO_OP}).run_id)
            _settled([ids[-1]], timeout=120)
            time.sleep(0.05)
    finally:
        stop_runworker(workers)
    waits = [(started - created).total_seconds() * 1000
             for created, started in AgentRun.objects.filter(pk__in=ids).values_list("created_at", "started_at")]
    return {"runs": count, "ms": summary(waits), "mean_ms": statistics.fmean(waits)}


def main() -> None:
    args = parse_args()
    os.environ.setdefault("SCRIPTS_FROM_USERS_ALLOWED", "true")
    os.environ.setdefault("MAX_RUNS_IN_FLIGHT_PER_USER", "0")
    with bench_database("claim_rate"):
        rates = []
        for processes in args.process_counts:
            print(f"claim rate, {processes} worker process(es), {args.runs} runs …", flush=True)
            rates.append(rate_pass(processes, args.runs))
            print(f"  {rates[-1]['runs_per_s']:.1f} runs/s", flush=True)
        print("start → claim latency, NOTIFY …", flush=True)
        notify = latency_pass(args.latency_runs)
        print(f"start → claim latency, polling only (RUN_POLL_SECONDS={args.poll:g}) …", flush=True)
        polling = latency_pass(args.latency_runs, RUN_LISTEN="false", RUN_POLL_SECONDS=str(args.poll))
    print()
    print_table(
        ["worker processes", "runs", "runs/s", "new conn/run", "DB active ms/run"],
        [[r["processes"], r["runs"], f"{r['runs_per_s']:.1f}", f"{r['new_connections_per_run']:.3f}",
          f"{r['db_active_ms_per_run']:.1f}"] for r in rates],
    )
    print_table(
        ["wake-up", "runs", "p50 ms", "p95 ms"],
        [[name, r["runs"], f"{r['ms']['median']:.0f}", f"{r['ms']['p95']:.0f}"]
         for name, r in (("NOTIFY", notify), (f"polling every {args.poll:g} s", polling))],
    )
    rows = [
        row(f"runs claimed and settled per second, {r['processes']} worker process(es), no-op agent",
            round(r["runs_per_s"], 1), "runs/s")
        for r in rates
    ]
    rows += [
        row("new PostgreSQL connections per run (claim-rate passes, max)",
            round(max(r["new_connections_per_run"] for r in rates), 3), "connections"),
        row("start → claim latency p50, NOTIFY", round(notify["ms"]["median"]), "ms",
            peer=f"polling only every {args.poll:g} s", peer_value=round(polling["ms"]["median"])),
        row("start → claim latency p95, NOTIFY", round(notify["ms"]["p95"]), "ms",
            peer=f"polling only every {args.poll:g} s", peer_value=round(polling["ms"]["p95"])),
    ]
    save_results("claim_rate", rows, rates=rates, notify=notify, polling=polling)


if __name__ == "__main__":
    main()
