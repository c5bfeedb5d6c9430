"""The runs API under load: run detail reads and replay requests from 50 concurrent clients.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/replay_load.py \\
        [--runs 1000] [--clients 50] [--seconds 30] [--workers 4] [--replay-share 0.5]

A live server in the production setup docs/scale.md documents (uvicorn, ASGI, several worker
processes) on its own PostgreSQL database (agentledger_bench_replay, dropped at the end). It
holds --runs failed runs created by one user: half with `tools_executed = []` (a replay is
allowed, once: the next request for the same run finds it in flight), half with tools listed (a
replay without force is refused). The clients, authenticated with that user's token, each loop
for --seconds: pick a run at random, then either read it (`GET /api/runs/{id}/`) or ask for its
replay (`POST /api/runs/{id}/replay/`, without force). No django-q2 worker runs, so replays stay
queued, which is the replay_in_flight path a busy desk hits.

Printed: requests/s, p50/p99 per endpoint, the responses by status and refusal code, the 5xx
count (target 0) and, from the database afterwards, the replays created per run (target ≤ 1).
Peers: the detail read under load is compared with 100 reads by one client alone (measured just
before the load), the replay request with the detail read under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

from _benchdb import ROOT, bench_database
from _common import free_port, print_table, row, save_results, summary

os.environ.setdefault("LOG_LEVEL", "WARNING")

TOOLS = (["send_email"], ["lookup_customer", "send_email", "update_crm"])


def make_runs(count: int) -> tuple[str, list[str], set[str]]:
    """`count` failed runs by one user; returns (token, run ids, ids of the runs that may be replayed)."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission
    from django.utils import timezone
    from rest_framework.authtoken.models import Token

    from runs.models.ledger import AgentRun, RunStatus

    # An internal tool's account, as the manual's (docs/api.md): it acts for its end users.
    user = get_user_model().objects.create_user("bench-tool", password=None)
    user.user_permissions.add(Permission.objects.get(codename="act_for_any_owner"))
    token = Token.objects.create(user=user).key
    now = timezone.now()
    runs = [
        AgentRun(
            agent_name="support",
            owner_id=f"customer-{i % 100}",
            created_by=user,
            config={"message": "Jane asks about her refund.", "params": {}},
            status=RunStatus.ERROR,
            tools_executed=[] if i % 2 == 0 else TOOLS[i // 2 % 2],
            error_code="model_error",
            error_message="The model call failed: bench",
            session_id=f"bench-session-{i}",
            attempts=1,
            started_at=now,
            heartbeat_at=now,
            finished_at=now,
        )
        for i in range(count)
    ]
    AgentRun.objects.bulk_create(runs, batch_size=1000)
    ids = [str(run.run_id) for run in runs]
    return token, ids, {str(run.run_id) for run in runs if run.tools_executed == []}


def start_server(port: int, workers: int, var_dir: str, log) -> subprocess.Popen:
    from runs.management.commands.serve import web_command

    env = {
        **os.environ,
        "DEBUG": "false",
        "VAR_DIR": var_dir,
        "SECRET_KEY": secrets.token_urlsafe(40),
        "LOG_LEVEL": "WARNING",
    }
    return subprocess.Popen(
        web_command(host="127.0.0.1", port=port, workers=workers) + ["--no-access-log"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
    )


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()  # uvicorn's supervisor stops its workers in turn
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


def wait_ready(server: subprocess.Popen, url: str, token: str, run_id: str, workers: int, log_path: str) -> None:
    import httpx

    deadline = time.monotonic() + 120
    answered = 0
    # Every worker must be up before the clock starts: ask until a run of answers in a row.
    while answered < 4 * workers:
        try:
            response = httpx.get(f"{url}/api/runs/{run_id}/", headers={"Authorization": f"Token {token}"}, timeout=5)
            answered = answered + 1 if response.status_code == 200 else 0
        except httpx.TransportError:
            answered = 0
            time.sleep(0.2)
        if server.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            with open(log_path) as log:
                sys.exit(f"the server did not start: {log.read()[-3000:]}")


async def load(url: str, token: str, ids: list[str], *, clients: int, seconds: float, replay_share: float,
               seed: int) -> dict:
    import httpx

    latencies: dict[str, list[float]] = defaultdict(list)
    outcomes: Counter = Counter()
    transport_errors: Counter = Counter()
    rng = random.Random(seed)
    # Idle connections expire on the client before uvicorn's 5 s keep-alive closes them, so a
    # request never goes out on a connection the server is closing at that moment.
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Token {token}"}, limits=limits,
                                 timeout=60) as http:
        deadline = time.monotonic() + seconds

        async def client() -> None:
            # Bounded twice: by the clock and by a request count no client can reach in time.
            for _ in range(1_000_000):
                if time.monotonic() >= deadline:
                    return
                run_id = rng.choice(ids)
                replay = rng.random() < replay_share
                endpoint = "replay" if replay else "detail"
                started = time.perf_counter()
                try:
                    if replay:
                        response = await http.post(f"/api/runs/{run_id}/replay/", json={})
                    else:
                        response = await http.get(f"/api/runs/{run_id}/")
                except httpx.HTTPError as error:
                    transport_errors[f"{endpoint} {type(error).__name__}"] += 1
                    continue
                latencies[endpoint].append((time.perf_counter() - started) * 1000)
                code = ""
                if response.status_code >= 400 and response.headers.get("content-type", "").startswith("application/json"):
                    code = response.json().get("code", "")
                outcomes[(endpoint, response.status_code, code)] += 1

        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.monotonic() - started
    return {"latencies": latencies, "outcomes": outcomes, "transport_errors": transport_errors, "elapsed": elapsed}


def one_client(url: str, token: str, ids: list[str], requests: int, seed: int) -> list[float]:
    """Run detail reads one at a time: the latency the load is compared with."""
    import httpx

    rng = random.Random(seed)
    samples = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Token {token}"}, timeout=60) as http:
        for _ in range(requests):
            started = time.perf_counter()
            response = http.get(f"/api/runs/{rng.choice(ids)}/")
            samples.append((time.perf_counter() - started) * 1000)
            if response.status_code != 200:
                sys.exit(f"GET run detail answered {response.status_code}: {response.text[:500]}")
    return samples


def replays_per_run(allowed: set[str]) -> dict:
    from django.db.models import Count, Max

    from runs.models.ledger import AgentRun

    per_run = (
        AgentRun.objects.filter(replay_of__isnull=False).values("replay_of").annotate(n=Count("pk"))
    )
    replayed = {str(item["replay_of"]): item["n"] for item in per_run}
    return {
        "replays": sum(replayed.values()),
        "runs_replayed": len(replayed),
        "max_per_run": per_run.aggregate(most=Max("n"))["most"] or 0,
        "refused_runs_replayed": len(set(replayed) - allowed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--workers", type=int, default=4, help="uvicorn worker processes")
    parser.add_argument("--replay-share", type=float, default=0.5, help="share of requests that ask for a replay")
    parser.add_argument("--seed", type=int, default=20261129)
    args = parser.parse_args()
    if args.runs < 2 or args.clients < 1 or args.workers < 1 or not 0 < args.seconds <= 600:
        parser.error("--runs ≥ 2, --clients ≥ 1, --workers ≥ 1 and 0 < --seconds ≤ 600")
    if not 0 <= args.replay_share <= 1:
        parser.error("--replay-share is a share between 0 and 1")

    with bench_database("replay"), tempfile.TemporaryDirectory(prefix="replay-load-") as var_dir:
        token, ids, allowed = make_runs(args.runs)
        print(f"{args.runs:,} failed runs ({len(allowed):,} replayable, {args.runs - len(allowed):,} with tools listed)")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = os.path.join(var_dir, "server.log")
        with open(log_path, "w") as log:
            server = start_server(port, args.workers, var_dir, log)
        try:
            wait_ready(server, url, token, ids[0], args.workers, log_path)
            print(f"uvicorn with {args.workers} workers on {url}; {args.clients} clients for {args.seconds:g} s",
                  flush=True)
            alone = summary(one_client(url, token, ids, 100, args.seed))
            print(f"one client, run detail reads one at a time: p50 {alone['median']:.1f} ms, "
                  f"p99 {alone['p99']:.1f} ms", flush=True)
            result = asyncio.run(load(url, token, ids, clients=args.clients, seconds=args.seconds,
                                      replay_share=args.replay_share, seed=args.seed))
        finally:
            stop_server(server)
        with open(log_path) as log:
            server_errors = log.read()
        database = replays_per_run(allowed)

    latencies, outcomes, elapsed = result["latencies"], result["outcomes"], result["elapsed"]
    total = sum(len(v) for v in latencies.values())
    stats = {endpoint: summary(values) for endpoint, values in sorted(latencies.items())}
    fives = sum(count for (_, status, _), count in outcomes.items() if status >= 500)
    throughput = total / elapsed

    print(f"\n{total:,} requests in {elapsed:.1f} s: {throughput:,.0f} requests/s\n")
    print_table(
        ["endpoint", "requests", "req/s", "p50 ms", "p95 ms", "p99 ms"],
        [[endpoint, s["n"], f"{s['n'] / elapsed:,.0f}", f"{s['median']:.1f}", f"{s['p95']:.1f}", f"{s['p99']:.1f}"]
         for endpoint, s in stats.items()],
    )
    print("\nresponses")
    print_table(
        ["endpoint", "status", "code", "count"],
        [[endpoint, status, code or "-", count] for (endpoint, status, code), count in sorted(outcomes.items())],
    )
    if result["transport_errors"]:
        print(f"\ntransport errors: {dict(result['transport_errors'])}")
    print(f"\n5xx responses: {fives} (target 0)")
    print(f"replays created: {database['replays']:,} for {database['runs_replayed']:,} runs; at most "
          f"{database['max_per_run']} per run (target ≤ 1); runs with tools listed that were replayed: "
          f"{database['refused_runs_replayed']}")
    if (fives or result["transport_errors"]) and server_errors.strip():
        print("\nserver stderr (tail):\n" + server_errors[-3000:])

    detail, replay = stats.get("detail"), stats.get("replay")
    rows = [
        row("requests/s, reads and replays mixed", throughput, "req/s"),
        row("5xx responses", fives, "", target="= 0", correctness=True),
        row("transport errors (no response)", sum(result["transport_errors"].values()), "", target="= 0", correctness=True),
        # A replay refused for every run (a permission the account lost, say) measures nothing.
        row("runs replayed", database["runs_replayed"], "", target="≥ 1", correctness=True),
        row("replays created per run, most", database["max_per_run"], "", target="≤ 1", correctness=True),
        row("replays of runs with tools listed", database["refused_runs_replayed"], "", target="= 0", correctness=True),
    ]
    if detail:
        rows += [
            row("GET run detail p50", detail["median"], "ms", peer="one client alone", peer_value=alone["median"]),
            row("GET run detail p99", detail["p99"], "ms", peer="one client alone", peer_value=alone["p99"]),
        ]
    if replay:
        rows += [
            row("POST replay p50", replay["median"], "ms", peer="GET run detail p50",
                peer_value=detail["median"] if detail else None),
            row("POST replay p99", replay["p99"], "ms", peer="GET run detail p99",
                peer_value=detail["p99"] if detail else None),
        ]
    save_results(
        "replay_load",
        rows,
        parameters=vars(args),
        endpoints=stats,
        one_client=alone,
        responses=[{"endpoint": e, "status": s, "code": c, "count": n} for (e, s, c), n in sorted(outcomes.items())],
        database=database,
    )


if __name__ == "__main__":
    main()
