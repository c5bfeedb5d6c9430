"""Benchmark: purge 1,000,000 old ADK events among 2,000,000 (PostgreSQL).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/purge_events.py

Builds its own database (agentledger_bench_purge) with generate_series: 20,000 sessions, 2,000,000
events (half of them 100-130 days old), 50 running runs whose old events must survive. Runs
the batched purge (PURGE_BATCH_SIZE events per transaction) and prints events deleted per
second and the longest single transaction; then reloads the old events and deletes them the
naive way, in one DELETE, as the peer. Drops the database at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _benchdb import bench_database, timed
from _common import row, save_results

os.environ.setdefault("LOG_LEVEL", "ERROR")

SESSIONS = 20_000
EVENTS = 2_000_000
OLD = 1_000_000
IN_FLIGHT_SESSIONS = 50
BATCH_SIZE = 5_000

SESSIONS_SQL = """
INSERT INTO sessions (app_name, user_id, id, state, create_time, update_time)
SELECT 'support', 'owner-' || mod(g, 1000), 'sess-' || g, '{{}}'::jsonb,
       (now() at time zone 'utc') - interval '130 days', (now() at time zone 'utc') - interval '1 day'
FROM generate_series(1, {sessions}) AS g
"""

# Event g belongs to session mod(g, SESSIONS) + 1; events 1..OLD are 100-130 days old.
EVENTS_SQL = """
INSERT INTO events (id, app_name, user_id, session_id, invocation_id, timestamp, event_data)
SELECT gen_random_uuid()::text, 'support', 'owner-' || mod(mod(g, {sessions}) + 1, 1000),
       'sess-' || (mod(g, {sessions}) + 1), 'e-' || md5(g::text),
       CASE WHEN g <= {old} THEN (now() at time zone 'utc') - interval '130 days' + (g * interval '2.5 seconds')
            ELSE (now() at time zone 'utc') - ((g - {old}) * interval '0.5 seconds') END,
       jsonb_build_object(
         'author', 'support', 'invocation_id', 'e-' || md5(g::text),
         'content', jsonb_build_object('role', 'model', 'parts',
                    jsonb_build_array(jsonb_build_object('text', repeat('Your refund is on its way. ', 10)))),
         'custom_metadata', jsonb_build_object('run_id', md5(g::text)))
FROM generate_series({first}, {last}) AS g
"""


def load_events(first: int, last: int) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(EVENTS_SQL.format(sessions=SESSIONS, old=OLD, first=first, last=last))
        cursor.execute("ANALYZE events")


def load() -> None:
    from django.db import connection

    from runs.models.ledger import AgentRun, RunStatus

    with connection.cursor() as cursor:
        cursor.execute(SESSIONS_SQL.format(sessions=SESSIONS))
    load_events(1, EVENTS)
    AgentRun.objects.bulk_create(
        AgentRun(agent_name="support", owner_id=f"owner-{g % 1000}", session_id=f"sess-{g}",
                 config={"message": "hi", "params": {}}, status=RunStatus.RUNNING, attempts=1)
        for g in range(1, IN_FLIGHT_SESSIONS + 1)
    )


def protected_old_events(cutoff) -> int:
    from agents.models import AdkEvent

    return AdkEvent.objects.filter(
        timestamp__lt=cutoff, session_id__in=[f"sess-{g}" for g in range(1, IN_FLIGHT_SESSIONS + 1)]
    ).count()


def main() -> None:
    global SESSIONS, EVENTS, OLD
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=EVENTS, help="events in the table: half old, 100 a session")
    EVENTS = max(parser.parse_args().events, 2 * IN_FLIGHT_SESSIONS * 100)
    SESSIONS, OLD = EVENTS // 100, EVENTS // 2
    with bench_database("purge"):
        from django.db import connection, transaction

        from agents.models import AdkEvent, AdkSession
        from runs.upkeep import retention

        figures: dict[str, float] = {}
        print(f"loading {SESSIONS:,} sessions and {EVENTS:,} events ({OLD:,} old)")
        with timed("load with generate_series", figures):
            load()

        dry = retention.purge_events(days=90, dry_run=True)
        protected = protected_old_events(dry.cutoff)
        print(f"  to delete: {dry.would_delete:,}; old events kept because their run is running: {protected:,}")
        assert dry.would_delete == OLD - protected

        batches: list[float] = []
        report = retention.purge_events(days=90, batch_size=BATCH_SIZE, on_batch=lambda r: batches.append(r.batch_seconds[-1]))
        assert report.deleted == OLD - protected, report.deleted
        assert AdkSession.objects.count() == SESSIONS
        assert AdkEvent.objects.filter(timestamp__lt=report.cutoff).count() == protected
        print("\nbatched purge (each batch its own transaction)")
        print(f"  deleted {report.deleted:,} events in {report.batches} batches of {BATCH_SIZE:,} in {report.seconds:.2f} s")
        print(f"  {report.events_per_second:,.0f} events/s")
        print(f"  longest transaction {report.longest_batch_seconds * 1000:.0f} ms, "
              f"median {statistics.median(batches) * 1000:.0f} ms, p95 "
              f"{sorted(batches)[int(len(batches) * 0.95)] * 1000:.0f} ms")

        # Peer: the same rows, deleted in one statement and one transaction.
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE events")
        AdkEvent.objects.filter(timestamp__lt=report.cutoff).delete()
        load_events(1, OLD)
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE events")
        started = time.perf_counter()
        with transaction.atomic():
            single, _ = retention.purgeable_events(cutoff=report.cutoff).delete()
        single_seconds = time.perf_counter() - started
        print("\npeer: one DELETE in one transaction")
        print(f"  deleted {single:,} events in {single_seconds:.2f} s ({single / single_seconds:,.0f} events/s)")
        print(f"  longest transaction {single_seconds * 1000:.0f} ms")

        print("\nresults")
        print(f"  batched: {report.events_per_second:,.0f} events/s, longest transaction "
              f"{report.longest_batch_seconds * 1000:.0f} ms")
        print(f"  single:  {single / single_seconds:,.0f} events/s, longest transaction {single_seconds * 1000:.0f} ms")
        print(f"  throughput batched / single: {report.events_per_second / (single / single_seconds):.2f}x; "
              f"longest transaction single / batched: {single_seconds / report.longest_batch_seconds:,.0f}x shorter")
        save_results(
            "purge_events",
            [
                row(f"batched purge of {report.deleted:,} events among {EVENTS:,}", report.events_per_second,
                    "events/s", peer="one DELETE", peer_value=single / single_seconds),
                row("longest transaction", report.longest_batch_seconds * 1000, "ms",
                    peer="one DELETE", peer_value=single_seconds * 1000),
                row("median transaction", statistics.median(batches) * 1000, "ms"),
            ],
            events=EVENTS, old=OLD, batch_size=BATCH_SIZE, batches=report.batches, seconds=report.seconds,
            single_delete_seconds=single_seconds,
        )


if __name__ == "__main__":
    main()
