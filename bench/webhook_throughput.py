"""Webhook inbox throughput on PostgreSQL: events accepted and processed per second, one worker killed.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/webhook_throughput.py [--events 300]

Builds its own database (agentledger_bench_webhooks), starts the ASGI server (uvicorn, as
`manage.py serve` does) and 4 worker processes that call the inbox's processing
(`runs.inbox.processing.process_due`: claim with a lease, run, settle). Signed events are POSTed over
HTTP by 8 client threads, each event twice (the redelivery must answer 200 and store nothing).
The scripted agent makes one read-only tool call (lookup_customer) per event. When 40 % of the
events are settled one worker is killed with SIGKILL; the others take its event over once its
lease runs out. The run then checks that every accepted event was processed exactly once: 0
duplicates (events stored twice, or processed by two successful runs), 0 lost (events never
settled).

Peer, in the same run: the same number of runs of the same agent and script, started directly
with `runs.services.run.start_run` (no inbox, no HTTP) and executed by 4 worker processes. The
ratio says what the inbox costs on top of the run ledger. Drops the database at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _benchdb import bench_database
from _common import free_port, row, save_results

BASE_DIR = Path(__file__).resolve().parent.parent
WORKERS = 4
CLIENT_THREADS = 8
SECRET = "bench-shared-secret-0123456789"
SCRIPT = [{"call": "lookup_customer", "args": {"email": "jane@example.com"}}, {"say": "Jane is on the pro plan."}]

os.environ.setdefault("LOG_LEVEL", "WARNING")
# A killed worker's event is taken over within seconds instead of minutes.
os.environ.setdefault("WEBHOOK_LEASE_SECONDS", "4")
os.environ.setdefault("RUN_STALE_AFTER_SECONDS", "3")
os.environ.setdefault("RUN_HEARTBEAT_SECONDS", "1")
os.environ.setdefault("WEBHOOK_RETRY_DELAYS", "1")
os.environ.setdefault("SCRIPTED_FAULTS_ENABLED", "true")
os.environ.setdefault("EMAIL_BACKEND", "django.core.mail.backends.locmem.EmailBackend")

INBOX_WORKER = """
import time, django
django.setup()
from runs.execution import executor
from runs.ledger import lifecycle
from runs.services import run as services  # noqa: F401 - imports ADK before saying ready
from runs.inbox import processing  # noqa: F401
print("ready", flush=True)
worker = lifecycle.worker_name()
while True:
    if not processing.process_due(worker=worker):
        time.sleep(0.05)
"""

DIRECT_WORKER = """
import random, sys, time, django
django.setup()
from runs.execution import executor
from runs.models.ledger import AgentRun
print("ready", flush=True)
while True:
    queued = list(AgentRun.objects.filter(status="queued").order_by("created_at").values_list("pk", flat=True)[:16])
    if not queued:
        if not AgentRun.objects.filter(status__in=["queued", "running"]).exists():
            break
        time.sleep(0.05)
        continue
    executor.execute(random.choice(queued))  # a lost claim does nothing; the next pick is another run
"""


def start_workers(code: str, count: int) -> list[subprocess.Popen]:
    workers = [
        subprocess.Popen([sys.executable, "-c", code], cwd=BASE_DIR, env=dict(os.environ),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    for worker in workers:
        line = worker.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"a worker did not start: {worker.stderr.read()[-2000:]}")
    return workers


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def start_server(port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning", "--no-access-log"],
        cwd=BASE_DIR, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/api/", timeout=1)
            return server
        except httpx.TransportError:
            time.sleep(0.2)
    raise SystemExit(f"the server did not start: {server.stderr.read()[-2000:]}")


def settled_count() -> int:
    from runs.models.inbox import WebhookEvent

    return WebhookEvent.objects.filter(status__in=["done", "needs_review", "dead"]).count()


def inbox_run(events: int, port: int) -> dict:
    import httpx

    from runs.inbox.signing import sign_timestamped
    from runs.models.inbox import WebhookEvent
    from runs.models.ledger import AgentRun

    bodies = [json.dumps({"from": "jane@example.com", "text": f"Question {n}", "n": n}).encode() for n in range(events)]
    message_ids = [f"bench-{uuid.uuid4()}" for _ in range(events)]
    # Every event delivered twice, the redelivery a little later (as providers do after a timeout).
    deliveries = [(n, first) for n in range(events) for first in (True, False)]
    deliveries.sort(key=lambda item: (item[0] + (0 if item[1] else 8), not item[1]))
    answers: dict[int, list[tuple[int, str]]] = {n: [] for n in range(events)}
    lock = threading.Lock()
    local = threading.local()

    def post(item) -> None:
        n, _ = item
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        response = client.post(
            "/api/webhooks/bench/", content=bodies[n],
            # Signed when sent, as a provider signs each attempt (a signature's time must be recent).
            headers={"Content-Type": "application/json",
                     "X-Signature": sign_timestamped(SECRET, bodies[n], message_id=message_ids[n]),
                     "X-Message-Id": message_ids[n]},
        )
        with lock:
            answers[n].append((response.status_code, response.json().get("event_id", "")))

    workers = start_workers(INBOX_WORKER, WORKERS)
    killed_pid = None
    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(CLIENT_THREADS) as pool:
            list(pool.map(post, deliveries))
        accepted_s = time.perf_counter() - started

        deadline = time.monotonic() + 1800
        while True:
            done = settled_count()
            if killed_pid is None and done >= 0.4 * events:
                victim = workers[0]
                killed_pid = victim.pid
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait()
                print(f"  killed worker pid {killed_pid} (SIGKILL) with {done}/{events} events settled")
            if done >= events:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"only {done}/{events} events settled after 30 minutes")
            time.sleep(0.1)
        processed_s = time.perf_counter() - started
    finally:
        stop(workers)

    codes = sorted(code for replies in answers.values() for code, _ in replies)
    ids_per_event = {n: {event_id for _, event_id in replies} for n, replies in answers.items()}
    accepted_ids = {next(iter(ids)) for ids in ids_per_event.values() if len(ids) == 1}
    statuses: dict[str, int] = {}
    for status in WebhookEvent.objects.values_list("status", flat=True):
        statuses[status] = statuses.get(status, 0) + 1
    successes_per_event = {}
    for event_id in AgentRun.objects.filter(status="success").values_list("webhook_event_id", flat=True):
        successes_per_event[event_id] = successes_per_event.get(event_id, 0) + 1
    settled_ids = {str(pk) for pk in WebhookEvent.objects.filter(status__in=["done", "needs_review", "dead"])
                   .values_list("pk", flat=True)}
    return {
        "accepted_s": accepted_s,
        "processed_s": processed_s,
        "answers_202": codes.count(202),
        "answers_200": codes.count(200),
        "other_answers": len(codes) - codes.count(202) - codes.count(200),
        "stored": WebhookEvent.objects.count(),
        "split_ids": sum(1 for ids in ids_per_event.values() if len(ids) != 1),
        "duplicates": (WebhookEvent.objects.count() - events) + sum(1 for c in successes_per_event.values() if c > 1),
        "lost": len(accepted_ids - settled_ids),
        "statuses": statuses,
        "runs": AgentRun.objects.filter(webhook_event__isnull=False).count(),
        "in_flight": AgentRun.objects.filter(status__in=["queued", "running"]).count(),
        "retried": WebhookEvent.objects.filter(attempts__gt=1).count(),
    }


def direct_run(events: int) -> float:
    from runs.services import run as services

    for n in range(events):
        services.start_run(agent_name="support", message=f"Question {n}", owner_id="direct-owner",
                           params={"script": SCRIPT}, enqueue=False)
    workers = start_workers(DIRECT_WORKER, WORKERS)
    # Timed from the moment every worker is up (the queue is already full; start-up is not counted).
    ready = time.perf_counter()
    for worker in workers:
        worker.wait(timeout=1800)
    return time.perf_counter() - ready


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=300)
    args = parser.parse_args()
    events = args.events
    os.environ.setdefault("WEBHOOK_ATTACHMENTS_DIR", tempfile.mkdtemp(prefix="bench-webhooks-"))

    with bench_database("webhooks"):
        from agents.models import Customer
        from runs.models.inbox import WebhookSource

        Customer.objects.get_or_create(email="jane@example.com",
                                       defaults={"name": "Jane Doe", "contact_id": "C-1001", "plan": "pro"})
        # Each side acts for its own owner, so neither reads the other's long-term memories.
        WebhookSource.objects.create(slug="bench", name="Bench", agent_name="support", owner_id="inbox-owner",
                                     secret=SECRET, message_id_header="X-Message-Id",
                                     instructions="Answer the customer.", params={"script": SCRIPT})
        port = free_port()
        server = start_server(port)
        try:
            print(f"inbox: {events} events (each delivered twice) over HTTP by {CLIENT_THREADS} threads, "
                  f"{WORKERS} worker processes, one killed at 40 %")
            inbox = inbox_run(events, port)
        finally:
            stop([server])

        print(f"peer: {events} runs started with start_run, executed by {WORKERS} worker processes")
        direct_s = direct_run(events)

        accepted_rate = events / inbox["accepted_s"]
        processed_rate = events / inbox["processed_s"]
        direct_rate = events / direct_s
        print("\nresults")
        print(f"  accepted: {events} events ({inbox['answers_202']} × 202, {inbox['answers_200']} redeliveries × 200, "
              f"{inbox['other_answers']} other) in {inbox['accepted_s']:.1f} s: {accepted_rate:.1f} events/s "
              f"({2 * events / inbox['accepted_s']:.1f} requests/s)")
        print(f"  processed: all {events} settled {inbox['processed_s']:.1f} s after the first delivery: "
              f"{processed_rate:.2f} events/s; statuses {inbox['statuses']}; {inbox['runs']} runs, "
              f"{inbox['retried']} event(s) retried, {inbox['in_flight']} run(s) left in flight")
        print(f"  duplicates: {inbox['duplicates']} (events stored {inbox['stored']} for {events} message ids; "
              f"{inbox['split_ids']} message id(s) answered with two event ids)")
        print(f"  lost: {inbox['lost']}")
        print(f"  peer, the same runs without the inbox: {direct_s:.1f} s, {direct_rate:.2f} runs/s")
        print(f"  ratio inbox / peer (processing throughput): {processed_rate / direct_rate:.2f}")
        save_results(
            "webhook_throughput",
            [
                row("events accepted over HTTP", accepted_rate, "events/s"),
                row("events processed, 4 workers, one killed", processed_rate, "events/s",
                    peer="the same runs without the inbox", peer_value=direct_rate),
                row("duplicates", inbox["duplicates"], target="= 0", correctness=True),
                row("lost events", inbox["lost"], target="= 0", correctness=True),
            ],
        )
        if inbox["duplicates"] or inbox["lost"] or inbox["other_answers"] or inbox["split_ids"]:
            raise SystemExit("FAILED: duplicates or lost events")


if __name__ == "__main__":
    main()
