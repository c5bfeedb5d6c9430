"""Benchmark: one reconciliation sweep over 1,000,000 runs of which 1,000 are stale (PostgreSQL).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/reconcile_sweep.py

Builds its own database (agentledger_bench_reconcile) with generate_series, prints the query
plans of the candidate scans, the seconds per sweep (1,000 stale runs reconciled, and the
every-minute sweep that finds nothing), and the same empty sweep's candidate scan with index
scans disabled as the peer. Drops the database at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

from _benchdb import bench_database, timed
from _common import row, save_results

# One warning per reconciled run is right in production, noise here.
os.environ.setdefault("LOG_LEVEL", "ERROR")

TOTAL = 1_000_000
STALE = 1_000
LIVE = 2_000
QUEUED = 500

def explicit() -> dict[str, str]:
    # Built when called: --stale sets STALE first.
    return {
        "run_id": "gen_random_uuid()",
        "trigger": "'api'",
        "agent_name": "'support'",
        "owner_id": "'owner-' || mod(g, 5000)",
        "config": """'{"message": "Refund Jane", "params": {}}'::jsonb""",
        "session_id": "gen_random_uuid()::text",
        "attempts": f"CASE WHEN g > {STALE + LIVE} AND g <= {STALE + LIVE + QUEUED} THEN 0 ELSE 1 END",
        "status": f"""CASE WHEN g <= {STALE} THEN 'running'
                            WHEN g <= {STALE + LIVE} THEN 'running'
                            WHEN g <= {STALE + LIVE + QUEUED} THEN 'queued'
                            WHEN mod(g, 10) = 0 THEN 'error' ELSE 'success' END""",
        "created_at": f"""CASE WHEN g <= {STALE + LIVE} THEN now() - interval '15 minutes'
                                WHEN g <= {STALE + LIVE + QUEUED} THEN now() - interval '1 minute'
                                ELSE now() - (g * interval '15 seconds') END""",
        "started_at": f"CASE WHEN g > {STALE + LIVE} AND g <= {STALE + LIVE + QUEUED} THEN NULL "
                      "ELSE now() - (g * interval '15 seconds') END",
        "heartbeat_at": f"""CASE WHEN g <= {STALE} THEN now() - interval '10 minutes' - (g * interval '1 second')
                                  WHEN g <= {STALE + LIVE} THEN now() - (mod(g, 20) * interval '1 second')
                                  WHEN g <= {STALE + LIVE + QUEUED} THEN NULL
                                  ELSE now() - (g * interval '15 seconds') + interval '30 seconds' END""",
        "finished_at": f"CASE WHEN g > {STALE + LIVE + QUEUED} THEN now() - (g * interval '15 seconds') "
                       "+ interval '40 seconds' END",
        "tools_executed": f"""CASE WHEN g > {STALE + LIVE + QUEUED} THEN '["send_email"]'::jsonb END""",
        "worker": "'bench-host:' || mod(g, 8)",
    }


def load_runs() -> None:
    from django.db import connection

    from runs.models.ledger import AgentRun

    columns, expressions, params = [], [], []
    EXPLICIT = explicit()
    for field in AgentRun._meta.concrete_fields:
        columns.append(field.column)
        if field.column in EXPLICIT:
            expressions.append(EXPLICIT[field.column])
        elif field.null:
            expressions.append("NULL")
        else:  # every other NOT NULL column gets the model's own default
            expressions.append("%s")
            params.append(field.get_db_prep_save(field.get_default(), connection))
    sql = (
        f"INSERT INTO agent_runs ({', '.join(columns)}) "
        f"SELECT {', '.join(expressions)} FROM generate_series(1, {TOTAL}) AS g"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        cursor.execute("ANALYZE agent_runs")


def explain_candidates() -> None:
    from runs.ledger import reconcile

    by_heartbeat, never_heard = reconcile.candidate_querysets(reconcile.Cutoffs.at())
    print("\nEXPLAIN ANALYZE, stale by heartbeat:")
    print(by_heartbeat.explain(analyze=True, buffers=True))
    print("\nEXPLAIN ANALYZE, never heard from:")
    print(never_heard.explain(analyze=True, buffers=True))


def candidate_scan_seconds(repeats: int = 15) -> float:
    from runs.ledger import reconcile

    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        reconcile._stale_ids(reconcile.Cutoffs.at(), None)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    global TOTAL, STALE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=TOTAL, help=f"runs in the table (at least stale + {LIVE + QUEUED:,})")
    parser.add_argument("--stale", type=int, default=STALE, help="stale running runs each sweep reconciles")
    parser.add_argument("--sweeps", type=int, default=3, help="sweeps over the stale runs (the median is reported)")
    args = parser.parse_args()
    STALE = args.stale
    TOTAL = max(args.runs, STALE + LIVE + QUEUED)
    with bench_database("reconcile"):
        from django.db import connection
        from django.utils import timezone

        from runs.ledger import reconcile
        from runs.models.ledger import AgentRun, RunStatus

        figures: dict[str, float] = {}
        print(f"loading {TOTAL:,} runs ({STALE:,} stale running, {LIVE:,} live running, {QUEUED} queued)")
        with timed("load with generate_series", figures):
            load_runs()
        live = AgentRun.objects.filter(status=RunStatus.RUNNING, heartbeat_at__gt=timezone.now() - timedelta(minutes=9))
        live_ids = list(live.values_list("run_id", flat=True))
        assert len(live_ids) == LIVE
        # The live workers keep beating (loading takes longer than the stale window).
        AgentRun.objects.filter(pk__in=live_ids).update(heartbeat_at=timezone.now())
        explain_candidates()

        print("\nsweeps:")
        rounds = []
        for attempt in range(args.sweeps):
            AgentRun.objects.filter(pk__in=live_ids).update(heartbeat_at=timezone.now())
            started = time.perf_counter()
            landed = reconcile.reconcile_stale_runs()
            rounds.append(time.perf_counter() - started)
            assert len(landed) == STALE, len(landed)
            print(f"  sweep {attempt + 1}: reconciled {len(landed):,} of {TOTAL:,} runs in {rounds[-1]:.3f} s")
            if attempt < args.sweeps - 1:  # make the same runs stale again for the next round
                AgentRun.objects.filter(error_code="reconciled").update(
                    status=RunStatus.RUNNING, error_code="", error_message="", tools_executed=None, finished_at=None
                )
        assert AgentRun.objects.filter(status=RunStatus.RUNNING).count() == LIVE
        AgentRun.objects.filter(status=RunStatus.RUNNING).update(heartbeat_at=timezone.now())
        AgentRun.objects.filter(status=RunStatus.QUEUED).update(created_at=timezone.now())

        empty = []
        for _ in range(15):
            started = time.perf_counter()
            assert reconcile.sweep().reconciled == []
            empty.append(time.perf_counter() - started)
        indexed_scan = candidate_scan_seconds()
        with connection.cursor() as cursor:
            cursor.execute("SET enable_indexscan = off; SET enable_bitmapscan = off; SET enable_indexonlyscan = off")
        unindexed_scan = candidate_scan_seconds(repeats=5)
        with connection.cursor() as cursor:
            cursor.execute("RESET enable_indexscan; RESET enable_bitmapscan; RESET enable_indexonlyscan")

        print("\nresults")
        print(f"  sweep reconciling {STALE:,} stale runs among {TOTAL:,}: median {statistics.median(rounds):.3f} s "
              f"({STALE / statistics.median(rounds):,.0f} runs/s, {statistics.median(rounds) / STALE * 1000:.1f} ms a run)")
        print(f"  every-minute sweep with nothing stale (reconcile + lost chat turns): median {statistics.median(empty) * 1000:.1f} ms")
        print(f"  candidate scan with the (status, heartbeat_at) index: {indexed_scan * 1000:.2f} ms")
        print(f"  candidate scan with index scans disabled (peer):      {unindexed_scan * 1000:.2f} ms")
        print(f"  ratio peer / indexed: {unindexed_scan / indexed_scan:,.0f}x")
        save_results(
            "reconcile_sweep",
            [
                row(f"sweep reconciling {STALE:,} stale runs among {TOTAL:,}", statistics.median(rounds), "s"),
                row("reconciled runs per second", STALE / statistics.median(rounds), "runs/s"),
                row("every-minute sweep, nothing stale", statistics.median(empty) * 1000, "ms"),
                row("candidate scan, (status, heartbeat_at) index", indexed_scan * 1000, "ms",
                    peer="index scans disabled", peer_value=unindexed_scan * 1000),
            ],
            runs=TOTAL, stale=STALE, sweeps_seconds=rounds, empty_sweeps_seconds=empty,
        )


if __name__ == "__main__":
    main()
