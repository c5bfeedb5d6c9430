"""How long the support desk's run list takes on a big table, against Django's defaults.

Fills a database with N runs (once; reruns reuse them), then times the run list as a staff
user sees it, unfiltered and with the common filters, in two configurations measured in the
same run:
  desk     — the run admin as shipped: capped count, no full count, no facet counts;
  defaults — the same admin with Django's defaults: exact COUNT(*) and the full result count
             (facet counts left at Django's default, offered on request: "Show counts" on
             this table ran for over five minutes in a first attempt, so it is not measured).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \\
        .venv/bin/python bench/admin_changelist.py --runs 1000000 [--keep]

It prints the median of --repeat requests per page and the ratio defaults / desk. The runs are
written into agentledger_bench_admin, dropped at the end unless --keep (which also reuses the
runs a previous --keep run left).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

from _benchdb import bench_database
from _common import row, save_results

os.environ.setdefault("ALLOWED_HOSTS", "testserver,127.0.0.1,localhost")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the database (and reuse a kept one)")
    args = parser.parse_args()
    if args.runs < 1 or args.repeat < 1:
        parser.error("--runs and --repeat must be positive")
    with bench_database("admin", fresh=not args.keep, keep=args.keep):
        measure_pages(args)


def measure_pages(args) -> None:
    from django.conf import settings
    from django.contrib import admin
    from django.contrib.auth.models import User
    from django.core.paginator import Paginator
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from runs.models.ledger import AgentRun

    if "testserver" not in settings.ALLOWED_HOSTS:
        settings.ALLOWED_HOSTS.append("testserver")
    have = AgentRun.objects.count()
    if have < args.runs:
        print(f"Writing {args.runs - have} runs…", flush=True)
        started = time.perf_counter()
        now = timezone.now()
        statuses = ["success"] * 6 + ["error"] * 3 + ["cancelled"]
        tools = [["lookup_customer", "send_email", "update_crm"], [], None, ["send_email"]]
        batch = []
        for i in range(have, args.runs):
            batch.append(
                AgentRun(
                    run_id=uuid.uuid4(),
                    agent_name="support",
                    owner_id=f"customer-{i % 5000}",
                    config={"message": "bench", "params": {}},
                    status=statuses[i % len(statuses)],
                    tools_executed=tools[i % len(tools)],
                    error_message="The model call failed: bench" if i % 10 in (6, 7, 8) else "",
                    session_id=str(uuid.uuid4()),
                    created_at=now - timezone.timedelta(seconds=args.runs - i),
                    attempts=1,
                )
            )
            if len(batch) == 10_000:
                AgentRun.objects.bulk_create(batch)
                batch.clear()
        AgentRun.objects.bulk_create(batch)
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("ANALYZE agent_runs")
        print(f"…in {time.perf_counter() - started:.0f} s", flush=True)

    user, _ = User.objects.get_or_create(username="bench-admin", defaults={"is_staff": True, "is_superuser": True})
    client = Client()
    client.force_login(user)
    model_admin = admin.site._registry[AgentRun]
    shipped = {
        "paginator": model_admin.paginator,
        "show_full_result_count": model_admin.show_full_result_count,
        "show_facets": model_admin.show_facets,
    }
    defaults = {
        "paginator": Paginator,
        "show_full_result_count": True,
        "show_facets": admin.ShowFacets.ALLOW,
    }
    have_now = AgentRun.objects.count()
    pages = {
        "all runs": {},
        "status=error": {"status__exact": "error"},
        "tools=called": {"tools": "called"},
        "search owner": {"q": "customer-42"},
        "search run id": {"q": str(AgentRun.objects.order_by("created_at").values_list("run_id", flat=True)[have_now // 2])},
    }

    def measure(config: dict, query: dict) -> tuple[float, int]:
        for name, value in config.items():
            setattr(model_admin, name, value)
        timings, queries = [], 0
        for _ in range(args.repeat):
            with CaptureQueriesContext(connection) as captured:
                started = time.perf_counter()
                response = client.get("/admin/runs/agentrun/", query)
                timings.append(time.perf_counter() - started)
            assert response.status_code == 200, response.status_code
            queries = len(captured)
        return statistics.median(timings) * 1000, queries

    print(f"{connection.vendor}, {have_now} runs, median of {args.repeat} requests")
    print(f"{'page':<14} {'desk ms':>9} {'queries':>8} {'defaults ms':>12} {'queries':>8} {'ratio':>7}")
    rows = []
    for label, query in pages.items():
        desk_ms, desk_q = measure(shipped, query)
        peer_ms, peer_q = measure(defaults, query)
        print(f"{label:<14} {desk_ms:>9.1f} {desk_q:>8} {peer_ms:>12.1f} {peer_q:>8} {peer_ms / desk_ms:>6.1f}x")
        rows.append(row(f"run list, {label}", desk_ms, "ms", peer="Django's defaults", peer_value=peer_ms))
    for name, value in shipped.items():
        setattr(model_admin, name, value)
    save_results("admin_changelist", rows, runs=have_now, repeat=args.repeat)


if __name__ == "__main__":
    main()
