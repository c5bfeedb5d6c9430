"""Waiting runs cost nothing while they wait, and the desk stays fast with them.

Fills agentledger_bench_approvals with the desk benchmark's ledger (N runs over 30 days, see
bench/desk_overview.py), measures the desk's first page (the peer: the same page on the same
ledger before any run waits), then adds W waiting runs, each with its open PendingCall (written by
INSERT … SELECT generate_series on the server, every NOT NULL column filled), and parks --real runs
for real: each run is claimed into this process's worker pool (runs.worker.processes), where the scripted
`support` agent asks for a refund's approval. Then it measures:

- what the waiting runs hold: the worker pool's busy slots, the runs under this process's
  heartbeat, and the connections open on the database (pg_stat_activity) once the process has
  released its idle ADK pool (compared with before the runs waited);
- the desk page again (server time through Django's test client, median of --repeat; target
  ≤ 300 ms), its "Approvals waiting" count, and the ratio against the page before.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \\
        .venv/bin/python bench/approvals.py --runs 1000000 --waiting 10000 [--keep]

Smoke size (seconds; the figures mean nothing): --runs 1000 --waiting 100 --real 2 --repeat 1.
"""

from __future__ import annotations

import argparse
import os
import time

from _benchdb import bench_database
from _common import row, save_results
from desk_overview import TARGET_MS, check_fills, fill, timed_get

os.environ.setdefault("ALLOWED_HOSTS", "testserver,127.0.0.1,localhost")

WAITING_SQL = """
INSERT INTO agent_runs (
    run_id, trigger, agent_name, owner_id, config, input_file, input_file_name, input_file_sha256,
    status, attempts, error_code, error_message, tools_executed, result, forced, force_reason,
    session_id, conversation_id, created_at, started_at, heartbeat_at, finished_at, worker,
    model_retries, trace_id, effects, agent_fingerprint, resume_reason, recovery, recovery_detail,
    continued_by_system
)
SELECT md5('w' || i::text)::uuid, 'api', 'support', 'customer-' || (i %% 5000),
       '{"message": "refund", "params": {}}'::jsonb, '', '', '', 'waiting', 1, '', '', '["issue_refund"]'::jsonb,
       '', false, '', md5('ws' || i::text), '', now() - (i * interval '1 minute'), now() - (i * interval '1 minute'),
       NULL, NULL, '', '[]'::jsonb, '', 'reuse', '', '', '', '', false
FROM generate_series(1, %(w)s) AS i
ON CONFLICT DO NOTHING
"""

PENDING_SQL = """
INSERT INTO pending_calls (run_id, kind, call_id, request_call_id, tool_name, agent_name, args, hint, payload_asked,
                           asked_at, decision, note, by_system, payload)
SELECT md5('w' || i::text)::uuid, 'confirmation', 'c-' || i, 'adk-' || i, 'issue_refund', 'support',
       '{"order_id": "A-1", "amount_cents": 25000}'::jsonb, '', NULL, now() - (i * interval '1 minute'), '', '',
       false, NULL
FROM generate_series(1, %(w)s) AS i
ON CONFLICT DO NOTHING
"""


def connections_open() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return cursor.fetchone()[0]


def connection_list() -> list[tuple]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pid = pg_backend_pid(), application_name, state, left(query, 60) FROM pg_stat_activity "
                       "WHERE datname = current_database()")
        return cursor.fetchall()


def park_real_runs(count: int) -> tuple[list, int, int]:
    """Park `count` runs for real, as a worker does: each run is claimed into a worker's run pool
    (runs.worker.processes), the scripted `support` agent asks for a refund's approval and the run leaves the
    pool `waiting`. Returns the ids, and the pool's capacity and busy slots after."""
    from django.conf import settings

    from runs.ledger import lifecycle
    from runs.models.ledger import AgentRun, RunStatus
    from runs.services import run as services
    from runs.worker import processes as worker

    # The pool a worker process runs; each run is claimed by id (the filled ledger holds old
    # queued rows a claim of the oldest would take) and adopted, as the worker does after its claim.
    pool = worker.RunPool(capacity=settings.RUN_CONCURRENCY)
    script = [{"call": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 25_000}}, {"say": "Refunded."}]
    ids = []
    for _ in range(count):
        run = services.start_run(agent_name="support", message="Refund", owner_id="bench",
                                 params={"script": script}, enqueue=False)
        claimed = lifecycle.claim_and_load_run(run_id=run.run_id, worker=lifecycle.worker_name())
        assert claimed is not None
        pool.adopt(claimed)
        ids.append(run.run_id)
    deadline = time.monotonic() + 120
    while AgentRun.objects.filter(pk__in=ids, status__in=[RunStatus.QUEUED, RunStatus.RUNNING]).exists() or pool.in_flight:
        if time.monotonic() > deadline:
            raise SystemExit("the real runs did not park within 120 s")
        time.sleep(0.05)
    return ids, pool.capacity, pool.in_flight


def slowest_queries(client, path: str, count: int) -> list[tuple[float, str]]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        client.get(path)
    timed = [(float(query["time"]) * 1000, " ".join(query["sql"].split())) for query in captured.captured_queries]
    return sorted(timed, reverse=True)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--real", type=int, default=20, help="runs parked for real through a worker's pool")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    with bench_database("approvals", fresh=not args.keep, keep=args.keep):
        from django.conf import settings
        from django.contrib.auth.models import User
        from django.db import connection
        from django.test import Client

        from agents.adk import release_process_resources
        from agents.models import Customer
        from runs.execution.heartbeat import process_heartbeat
        from runs.models.ledger import AgentRun, RunStatus
        from runs.rules import overview

        settings.SCRIPTED_FAULTS_ENABLED = True
        if "testserver" not in settings.ALLOWED_HOSTS:
            settings.ALLOWED_HOSTS.append("testserver")
        from runs.models.approvals import PendingCall

        check_fills(AgentRun, WAITING_SQL)
        check_fills(PendingCall, PENDING_SQL)
        fill(args.runs)
        Customer.objects.get_or_create(email="jane@example.com", defaults={"name": "Jane", "contact_id": "C-1001"})
        user, _ = User.objects.get_or_create(username="bench-admin", defaults={"is_staff": True, "is_superuser": True})
        client = Client()
        client.force_login(user)
        before_ms, before_queries, _ = timed_get(client, "/admin/desk/", args.repeat)

        connections_before = connections_open()
        with connection.cursor() as cursor:
            cursor.execute(WAITING_SQL, {"w": args.waiting})
            cursor.execute(PENDING_SQL, {"w": args.waiting})
            # What autovacuum does to a live table (as bench/desk_overview.py's fill does).
            cursor.execute("VACUUM ANALYZE agent_runs")
            cursor.execute("VACUUM ANALYZE pending_calls")
        parked, slots, busy = park_real_runs(args.real)
        held = len(process_heartbeat().run_ids())
        # The executor's process keeps its ADK pool (idle connections, whatever waits): release it.
        # What stays open is this process's own (its ORM thread's), one whatever the number waiting.
        release_process_resources()
        connections_after = connections_open()
        print("connections open after the runs waited:", connection_list())
        waiting = AgentRun.objects.filter(status=RunStatus.WAITING).count()
        really_parked = AgentRun.objects.filter(pk__in=parked, status=RunStatus.WAITING).count()

        after_ms, after_queries, page = timed_get(client, "/admin/desk/", args.repeat)
        counted = overview.build_overview().approvals_waiting.count
        ratio = after_ms / before_ms if before_ms else None
        print(f"postgresql, {AgentRun.objects.count()} runs, {waiting} waiting ({really_parked} of {args.real} parked "
              f"for real), median of {args.repeat} requests")
        print(f"held while waiting: {busy} of the worker pool's {slots} slots busy, {held} runs under this "
              f"process's heartbeat; connections on the database (pg_stat_activity) {connections_before} before, "
              f"{connections_after} after")
        print(f"desk overview before  {before_ms:8.1f} ms  {before_queries:3} queries")
        print(f"desk overview after   {after_ms:8.1f} ms  {after_queries:3} queries  (target ≤ {TARGET_MS} ms; "
              f"×{ratio:.2f} the page before)")
        print(f"Approvals waiting on the desk: {counted}; shown on the page: {b'Approvals waiting' in page}")
        print("the page's slowest queries (one more request):")
        for took, sql in slowest_queries(client, "/admin/desk/", 5):
            print(f"  {took:8.1f} ms  {sql[:160]}")
        for label, query in (("count of open calls", lambda: overview.capped_count(overview.open_pending_calls())),
                             ("oldest open call", overview.oldest_pending_call)):
            started = time.perf_counter()
            query()
            print(f"  {label}: {(time.perf_counter() - started) * 1000:.1f} ms")
        save_results(
            "approvals",
            [
                row("worker slots held by waiting runs", busy, "slots", target="= 0", correctness=True),
                row("heartbeat runs held by waiting runs", held, "runs", target="= 0", correctness=True),
                row("connections added by waiting runs", connections_after - connections_before, "connections"),
                row("desk overview with waiting runs, server time", round(after_ms, 1), "ms",
                    target=f"≤ {TARGET_MS}", peer="the same page before any run waited",
                    peer_value=round(before_ms, 1), ratio=round(ratio, 2) if ratio else None),
                row("desk overview, queries", after_queries, "queries"),
            ],
            runs=args.runs, waiting=waiting, repeat=args.repeat,
        )


if __name__ == "__main__":
    main()
