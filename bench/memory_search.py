#!/usr/bin/env python
"""Memory search latency on PostgreSQL: one owner's search among 1,000,000 memories.

Creates a dedicated database, applies the memory app's real migrations (so the index measured
is the one deployed), bulk-loads the memories server-side with generate_series, copies the
table without the full-text GIN index (the peer), and times the SQL of
`memory.services.search_memories` (the query agents and the API run) on both tables,
interleaved query by query, for typical owners (~100 memories each) and one heavy owner. Only
server round trips are timed, not ORM object building. The database is dropped at the end.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/memory_search.py

Options: --rows, --owners, --heavy, --queries, --keep (leave the database for inspection).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from _benchdb import bench_database
from _common import row, save_results

AGENT = "support"
PEER = "memory_entries_without_gin"
WARMUP = 20
COMMON_WORDS = (
    "order refund email delivery invoice account password address parcel payment card subscription "
    "plan discount warranty return exchange phone shipping tracking"
).split()
SYLLABLES = "ka lo mi ne su ta ri vo pe za du fi go ha je ku ly mo ny pa qu ro sa te vi wo xe yu".split()


def vocabulary(size: int, rng: random.Random) -> list[str]:
    words = list(COMMON_WORDS)
    seen = set(words)
    while len(words) < size:
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def skewed_index(rng: random.Random, size: int) -> int:
    # The same skew as the SQL loader: a few words are very common, most are rare.
    return int(size * rng.random() ** 3)


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--owners", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=400)
    parser.add_argument("--vocabulary", type=int, default=5_000)
    parser.add_argument(
        "--heavy", type=int, default=20_000, help="memories of one heavy owner (owner-0), out of --rows"
    )
    parser.add_argument("--keep", action="store_true", help="keep the benchmark database")
    args = parser.parse_args()

    with bench_database("memory", keep=args.keep):
        return run(args)


def run(args) -> int:
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection

    from memory import fulltext
    from memory.search import search_terms

    rng = random.Random(20261129)
    words = vocabulary(args.vocabulary, rng)

    typical = (args.rows - args.heavy) // (args.owners - 1)
    print(
        f"PostgreSQL {connection.pg_version // 10000}: {args.rows:,} memories of {args.owners:,} owners "
        f"(~{typical} each; owner-0 has {args.heavy:,}), vocabulary {len(words):,} words"
    )

    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO memory_entries
                (agent_name, owner_id, event_id, author, text, session_id, timestamp, added_at)
            SELECT %(agent)s,
                   CASE WHEN g <= %(heavy)s THEN 'owner-0'
                        ELSE 'owner-' || (1 + g %% (%(owners)s - 1)) END,
                   'event-' || g,
                   CASE WHEN g %% 2 = 0 THEN 'user' ELSE %(agent)s END,
                   (SELECT string_agg((%(words)s::text[])[1 + floor(%(n)s * power(random(), 3))::int], ' ')
                      FROM generate_series(1, 8 + g %% 13) AS w
                     WHERE g > 0),
                   'session-' || (g / 10),
                   now() - (g * interval '1 second'),
                   now()
              FROM generate_series(1, %(rows)s) AS g
            """,
            {
                "agent": AGENT,
                "owners": args.owners,
                "heavy": args.heavy,
                "words": words,
                "n": len(words),
                "rows": args.rows,
            },
        )
        cursor.execute("VACUUM ANALYZE memory_entries")
        cursor.execute("SELECT pg_size_pretty(pg_relation_size(%s))", [fulltext.PG_INDEX_NAME])
        index_size = cursor.fetchone()[0]
    print(f"loaded and indexed in {time.perf_counter() - started:.1f} s; GIN index {index_size}")

    def queries(owner_of) -> list[tuple[str, str]]:
        work = []
        for _ in range(args.queries):
            picked = {words[skewed_index(rng, len(words))] for _ in range(rng.randint(1, 3))}
            work.append((owner_of(), "what about " + " and ".join(sorted(picked)) + "?"))
        return work

    typical_work = queries(lambda: f"owner-{1 + rng.randrange(args.owners - 1)}")
    heavy_work = queries(lambda: "owner-0")

    from memory.models import MemoryEntry
    from memory.search import ranked

    def compiled(owner: str, query: str) -> tuple[str, list]:
        """The SQL and parameters of the very query memory.services.search_memories runs."""
        qs = ranked(MemoryEntry.objects.for_scope(agent=AGENT, owner_id=owner), query)[: settings.MEMORY_SEARCH_RESULTS]
        sql, params = qs.query.sql_with_params()
        return sql, list(params)

    # The peer: an identical copy of the table with every index but the GIN one, so both are
    # timed in the same run, interleaved query by query, under the same load.
    started = time.perf_counter()
    with connection.cursor() as cursor:
        # INCLUDING ALL keeps search_vector a generated column, and every index.
        cursor.execute(f"CREATE TABLE {PEER} (LIKE memory_entries INCLUDING ALL)")
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexdef ILIKE '%%USING gin%%'", [PEER]
        )
        for (name,) in cursor.fetchall():
            cursor.execute(f'DROP INDEX "{name}"')
        cursor.execute(f"INSERT INTO {PEER} (id, agent_name, owner_id, event_id, author, text, session_id, "
                       "run_id, timestamp, added_at) SELECT id, agent_name, owner_id, event_id, author, text, "
                       "session_id, run_id, timestamp, added_at FROM memory_entries")
        cursor.execute(f"VACUUM ANALYZE {PEER}")
    print(f"peer table without the GIN index built in {time.perf_counter() - started:.1f} s")

    def explain(sql: str, params: list) -> str:
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) " + sql, params)
            return "    " + "\n    ".join(row[0] for row in cursor.fetchall())

    def timed(cursor, sql: str, params: list) -> tuple[float, int]:
        t0 = time.perf_counter()
        cursor.execute(sql, params)
        rows = cursor.fetchall()
        return (time.perf_counter() - t0) * 1000, len(rows)

    def measure(label: str, work) -> dict[str, tuple[float, float]]:
        samples: dict[str, list[float]] = {"with": [], "without": []}
        hits = {"with": 0, "without": 0}
        with connection.cursor() as cursor:
            for i, (owner, query) in enumerate(work):
                sql, params = compiled(owner, query)
                peer_sql = sql.replace('"memory_entries"', f'"{PEER}"')
                order = [("with", sql), ("without", peer_sql)]
                if i % 2:
                    order.reverse()
                for key, statement in order:
                    elapsed, found = timed(cursor, statement, params)
                    if i >= WARMUP:
                        samples[key].append(elapsed)
                        hits[key] += found
        assert hits["with"] == hits["without"], "both tables must answer the same"
        print(f"\n{label} ({len(samples['with'])} searches, {hits['with']} results)")
        figures = {}
        for key in ("with", "without"):
            p50, p99 = percentile(samples[key], 0.50), percentile(samples[key], 0.99)
            figures[key] = (p50, p99)
            print(f"  {key + ' the GIN index':<24} p50 {p50:8.3f} ms   p99 {p99:8.3f} ms   "
                  f"mean {statistics.fmean(samples[key]):8.3f} ms")
        (p50_with, p99_with), (p50_without, p99_without) = figures["with"], figures["without"]
        print(f"  ratio without/with       p50 {p50_without / p50_with:8.2f}x   p99 {p99_without / p99_with:8.2f}x")
        return figures

    owner, query = typical_work[0]
    sql, params = compiled(owner, query)
    print(f"\nexample: owner {owner!r}, q={query!r} -> terms {search_terms(query)}")
    print("  with the GIN index:\n" + explain(sql, params))
    print("  without it:\n" + explain(sql.replace('"memory_entries"', f'"{PEER}"'), params))

    owner, query = heavy_work[0]
    sql, params = compiled(owner, query)
    print(f"\nexample: owner {owner!r}, q={query!r} -> terms {search_terms(query)}")
    print("  with the GIN index:\n" + explain(sql, params))
    print("  without it:\n" + explain(sql.replace('"memory_entries"', f'"{PEER}"'), params))

    typical_figures = measure("one typical owner's search", typical_work)
    heavy_figures = measure("the heavy owner's search (owner-0)", heavy_work)
    rows = []
    for who, figures in (("typical owner", typical_figures), ("heavy owner", heavy_figures)):
        for index, label in enumerate(("p50", "p99")):
            rows.append(row(f"search, {who}, {label}", figures["with"][index], "ms",
                            peer="without the GIN index", peer_value=figures["without"][index]))
    save_results("memory_search", rows, memories=args.rows, owners=args.owners, heavy_owner_memories=args.heavy,
                 queries=args.queries, gin_index_size=index_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
