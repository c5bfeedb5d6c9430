"""How long the desk's first page (and a /metrics scrape) takes on a ledger of a million runs.

Fills agentledger_bench_desk with N runs spread over 30 days (80 % success, 15 % error, 5 %
cancelled; failures split between tools called, none and unknown; a replay for some failures,
reconciled runs, calls in doubt, runs in flight, webhook events and schedule firings), written
by INSERT … SELECT generate_series on the server, then times the page as a superuser sees it:
the server's time for GET /admin/desk/ through Django's test client (no network), median of
--repeat requests, and its query count. Target: at most 300 ms.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \\
        .venv/bin/python bench/desk_overview.py --runs 1000000 [--keep]

The database is dropped at the end unless --keep (which also reuses the runs a kept one has).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

from _benchdb import bench_database
from _common import row, save_results

os.environ.setdefault("ALLOWED_HOSTS", "testserver,127.0.0.1,localhost")
TARGET_MS = 300

# Every NOT NULL column of agent_runs is written: Django's defaults are not the database's.
RUNS_SQL = """
INSERT INTO agent_runs (
    run_id, trigger, agent_name, owner_id, config, input_file, input_file_name, input_file_sha256,
    status, attempts, error_code, error_message, tools_executed, result, forced, force_reason,
    session_id, conversation_id, created_at, started_at, heartbeat_at, finished_at, worker,
    model_retries, trace_id, effects, agent_fingerprint, resume_reason, recovery, recovery_detail,
    continued_by_system
)
SELECT
    md5(i::text)::uuid,
    (ARRAY['api', 'api', 'webhook', 'schedule', 'chat'])[1 + i %% 5],
    'support', 'customer-' || (i %% 5000), '{"message": "bench", "params": {}}'::jsonb, '', '', '',
    CASE WHEN i > %(n)s - %(in_flight)s THEN (CASE WHEN i %% 3 = 0 THEN 'queued' ELSE 'running' END)
         WHEN i %% 20 < 16 THEN 'success' WHEN i %% 20 < 19 THEN 'error' ELSE 'cancelled' END,
    1,
    CASE WHEN i %% 200 = 17 THEN 'reconciled' WHEN i %% 20 IN (16, 17, 18) THEN 'model_error' ELSE '' END,
    CASE WHEN i %% 20 IN (16, 17, 18) THEN 'The model call failed: bench' ELSE '' END,
    CASE WHEN i %% 20 < 16 THEN '["lookup_customer"]'::jsonb
         WHEN (i / 20) %% 3 = 0 THEN NULL WHEN (i / 20) %% 3 = 1 THEN '[]'::jsonb
         ELSE '["send_email"]'::jsonb END,
    '', false, '', md5('s' || i::text), '',
    now() - ((%(n)s - i) * interval '30 days' / %(n)s),
    now() - ((%(n)s - i) * interval '30 days' / %(n)s),
    now() - ((%(n)s - i) * interval '30 days' / %(n)s) + interval '4 seconds',
    CASE WHEN i > %(n)s - %(in_flight)s THEN NULL
         ELSE now() - ((%(n)s - i) * interval '30 days' / %(n)s) + interval '5 seconds' END,
    CASE WHEN i > %(n)s - %(in_flight)s AND i %% 3 <> 0 THEN 'worker-' || (i %% 4) ELSE '' END,
    '[]'::jsonb, '', 'reuse', '', '', '', '', false
FROM generate_series(%(start)s, %(n)s) AS i
"""

# A successful replay for one failure in ten (i % 20 = 0 replays the error at i - 2).
REPLAYS_SQL = """
UPDATE agent_runs SET replay_of_id = md5((i - 2)::text)::uuid
FROM generate_series(20, %(n)s - %(in_flight)s, 200) AS i WHERE run_id = md5(i::text)::uuid
"""

CALLS_SQL = """
INSERT INTO tool_calls (run_id, seq, call_id, tool_name, args, status, called_at, response_summary,
                        agent_name, effect, effect_key, settle_note, settled_outcome)
SELECT md5(i::text)::uuid, 1, 'c-' || i, 'send_email', '{}'::jsonb,
       CASE WHEN i %% 7 = 0 THEN 'called' ELSE 'answered' END, now(), '', 'support', '', '', '', ''
FROM generate_series(18, %(n)s - %(in_flight)s, 60) AS i
"""


def unfilled_columns(model, sql: str) -> list[str]:
    """The NOT NULL columns of `model`'s table that an INSERT … SELECT leaves out (a new column, say)."""
    listed = set(re.findall(r"\w+", sql.split("SELECT", 1)[0].split("(", 1)[1]))
    return [field.column for field in model._meta.concrete_fields
            if not field.null and field.column not in listed and not field.get_internal_type().endswith("AutoField")]


def check_fills(model, sql: str) -> None:
    missing = unfilled_columns(model, sql)
    if missing:
        sys.exit(f"The benchmark's INSERT into {model._meta.db_table} leaves NOT NULL columns out: {', '.join(missing)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="keep the database (and reuse a kept one)")
    args = parser.parse_args()
    if args.runs < 1000 or args.repeat < 1:
        parser.error("--runs must be at least 1000 and --repeat positive")
    with bench_database("desk", fresh=not args.keep, keep=args.keep):
        fill(args.runs)
        measure(args)


def fill(n: int) -> None:
    from django.db import connection
    from django.utils import timezone

    from runs.models.inbox import WebhookEvent, WebhookSource
    from runs.models.ledger import AgentRun, ToolCall
    from runs.models.schedules import RunSchedule, ScheduleFiring

    check_fills(AgentRun, RUNS_SQL)
    check_fills(ToolCall, CALLS_SQL)
    have = AgentRun.objects.count()
    if have >= n:
        return
    print(f"Writing {n - have} runs…", flush=True)
    started = time.perf_counter()
    params = {"n": n, "start": have + 1, "in_flight": 60}
    with connection.cursor() as cursor:
        cursor.execute(RUNS_SQL, params)
        cursor.execute(REPLAYS_SQL, params)
        cursor.execute(CALLS_SQL, params)
    source = WebhookSource.objects.create(slug="bench", name="Bench", agent_name="support", owner_id="o",
                                          secret="s", message_id_header="X-Id")
    statuses = ["done"] * 90 + ["needs_review"] * 4 + ["dead"] * 2 + ["retry_wait"] * 4
    WebhookEvent.objects.bulk_create(
        WebhookEvent(source=source, external_id=f"m-{i}", payload={}, status=statuses[i % len(statuses)])
        for i in range(20_000)
    )
    now = timezone.now()
    for index in range(20):
        schedule = RunSchedule.objects.create(name=f"bench-{index}", agent_name="support", message="m",
                                              owner_id="o", interval_minutes=15)
        ScheduleFiring.objects.bulk_create(
            ScheduleFiring(schedule=schedule, slot=now - timezone.timedelta(minutes=15 * k),
                           fired_at=now - timezone.timedelta(minutes=15 * k),
                           outcome="skipped" if k % 9 == 0 else "started")
            for k in range(1, 7 * 24 * 4)
        )
    # What autovacuum does to a live table: statistics and the visibility map (index-only scans).
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")
    print(f"…in {time.perf_counter() - started:.0f} s", flush=True)


def timed_get(client, path: str, repeat: int) -> tuple[float, int, bytes]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.get(path)  # warm: the session, content types, the templates
    timings = []
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as captured:
            started = time.perf_counter()
            response = client.get(path)
            timings.append(time.perf_counter() - started)
        assert response.status_code == 200, response.status_code
    return statistics.median(timings) * 1000, len(captured), response.content


def measure(args) -> None:
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.test import Client

    from runs.models.ledger import AgentRun
    from runs.rules import overview

    if "testserver" not in settings.ALLOWED_HOSTS:
        settings.ALLOWED_HOSTS.append("testserver")
    settings.METRICS_ENABLED = True
    user, _ = User.objects.get_or_create(username="bench-admin", defaults={"is_staff": True, "is_superuser": True})
    client = Client()
    client.force_login(user)
    runs = AgentRun.objects.count()

    desk_ms, desk_queries, _page = timed_get(client, "/admin/desk/", args.repeat)
    metrics_ms, metrics_queries, _body = timed_get(client, "/metrics", args.repeat)
    data = overview.build_overview()
    print(f"postgresql, {runs} runs, median of {args.repeat} requests")
    print(f"desk overview   {desk_ms:8.1f} ms  {desk_queries:3} queries  (target ≤ {TARGET_MS} ms)")
    print(f"/metrics scrape {metrics_ms:8.1f} ms  {metrics_queries:3} queries")
    print(f"counts: tools_called {data.awaiting['tools_called']}, tools_unknown {data.awaiting['tools_unknown']}, "
          f"in doubt {data.calls_in_doubt}, reconciled 24 h {data.reconciled_24h}, in flight {data.in_flight.count}, "
          f"7-day runs {sum(bucket.total for bucket in data.daily)}")
    save_results(
        "desk_overview",
        [
            row("desk overview, server time", round(desk_ms, 1), "ms", target=f"≤ {TARGET_MS}"),
            row("desk overview, queries", desk_queries, "queries"),
            row("/metrics scrape, server time", round(metrics_ms, 1), "ms"),
        ],
        runs=runs, repeat=args.repeat,
    )


if __name__ == "__main__":
    main()
