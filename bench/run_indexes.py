"""What each index on `agent_runs` costs the writes every run makes.

A run's own writes to its row: start (INSERT, queued), claim (UPDATE to running under a lease),
settle (UPDATE to success). An UPDATE that changes an indexed column cannot be a HOT update, so
it writes an entry into every index of the table, not only the ones whose columns it changes.
This measures those three writes, through the ledger's own functions, with every index, and
then with each index dropped in turn (and made again right after), in alternating blocks:

    python bench/run_indexes.py [--runs 200] [--rounds 2]

The figure per index is what dropping it saves per run: wall time and the PostgreSQL backend's
CPU (utime + stime from /proc). The indexes stay what the migrations make; what to drop is a
decision for the queries that read them (bench/admin_changelist.py, bench/desk_overview.py,
bench/reconcile_sweep.py measure those).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _benchdb import bench_database
from _common import print_table, save_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="runs per block")
    parser.add_argument("--rounds", type=int, default=2, help="blocks per contender, interleaved")
    args = parser.parse_args()
    if min(args.runs, args.rounds) < 1:
        parser.error("--runs and --rounds must be positive")
    with bench_database("run_indexes"):
        measure(args)


def _backend_cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def measure(args: argparse.Namespace) -> None:
    from django.db import connection

    from runs.ledger import lifecycle
    from runs.models.ledger import AgentRun, RunStatus
    from runs.services import run as services

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s AND indexname NOT LIKE %s ORDER BY indexname",
            [AgentRun._meta.db_table, "%pkey"],
        )
        indexes = dict(cursor.fetchall())
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]

    worker = lifecycle.worker_name()

    def lifecycles(count: int) -> tuple[float, float]:
        cpu_before, started = _backend_cpu_ms(backend), time.perf_counter()
        for _ in range(count):
            run = services.start_run(agent_name="support", message="Index cost.", owner_id="bench", enqueue=False)
            claimed = lifecycle.claim_and_load_run(run_id=run.run_id, worker=worker)
            lifecycle.settle_run(run_id=run.run_id, status=RunStatus.SUCCESS, result="done", run=claimed)
        wall = (time.perf_counter() - started) * 1000 / count
        return wall, (_backend_cpu_ms(backend) - cpu_before) / count

    contenders = ["(every index)", *indexes]
    lifecycles(min(args.runs, 50))  # warm-up
    walls: dict[str, list[float]] = {name: [] for name in contenders}
    cpus: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name in contenders:
            if name in indexes:
                with connection.cursor() as cursor:
                    cursor.execute(f'DROP INDEX "{name}"')
            try:
                wall, cpu = lifecycles(args.runs)
            finally:
                if name in indexes:
                    with connection.cursor() as cursor:
                        cursor.execute(indexes[name])
            walls[name].append(wall)
            cpus[name].append(cpu)

    base_wall, base_cpu = statistics.median(walls[contenders[0]]), statistics.median(cpus[contenders[0]])
    rows, results = [], []
    for name in contenders:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        rows.append([name, f"{wall:.3f}", f"{cpu:.3f}", f"{base_wall - wall:+.3f}", f"{base_cpu - cpu:+.3f}"])
        if name in indexes:
            results.append({"metric": f"agent_runs index {name}: ms per run its writes cost", "value": base_wall - wall,
                            "unit": "ms"})
    print(f"\nstart + claim + settle, {args.runs} runs per block, {args.rounds} blocks each, "
          f"load average {', '.join(f'{value:.2f}' for value in os.getloadavg())}\n")
    print_table(["indexes", "ms/run", "PostgreSQL CPU ms/run", "saved by dropping (ms)", "CPU saved (ms)"], rows)
    save_results(
        "run_indexes",
        [{"metric": "start + claim + settle, every index", "value": base_wall, "unit": "ms"}, *results],
        walls=walls,
        cpus=cpus,
    )


if __name__ == "__main__":
    main()
