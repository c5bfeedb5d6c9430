"""Recovery without a person: seconds from a worker's SIGKILL to its run's successful end.

Real worker processes (`manage.py runworker`, default settings: RUN_STALE_AFTER_SECONDS=60,
RUN_HEARTBEAT_SECONDS=10, RUN_RECOVERY=resume) runs the `support` agent's two-effect script
(`send_email`, then `update_crm` after the model thinks for a second, then an answer). Each round
SIGKILLs the worker process holding the run between the two tool calls (the email sent, the CRM
note not yet; its parent sees it die) and times, from the kill, the moment the run's chain (the run and the continuation
the system started for it) ends in success. Each chain must hold exactly one email and one note.

Then the lost machine: a whole `runworker` (WORKER_HOST=lost) is SIGKILLed, no parent left to
notice, and another (WORKER_HOST=other) stands for the other machines; its sweep every few seconds
(`runs.worker.sweeper`) sees the dead processes' advisory locks gone (`runs.ledger.presence`) and continues the
run, without waiting for staleness.

Last, the price of fencing per durable event: statements, round trips and commits of one
function-call event with its journal row, unfenced (a run without a lease, as before) and fenced
(the run's lease checked inside the append's statement), read from libpq's trace.

    python bench/recovery.py [--kills 20] [--lost-machine 2] [--database NAME]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid

from _benchdb import ROOT, bench_database, use_database
from _common import print_table, row, save_results, summary


def main() -> None:
    args = parse_args()
    if args.database:
        use_database(args.database)  # an existing database of one's own: migrated, never dropped
        measure(args)
        return
    with bench_database("recovery"):
        measure(args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="worker SIGKILLs between two tool calls")
    parser.add_argument("--lost-machine", type=int, default=2, help="whole-cluster SIGKILLs (staleness only)")
    parser.add_argument("--events", type=int, default=200, help="appends per contender for the fencing accounting")
    parser.add_argument("--database", default="", help="run in this existing database instead of a throw-away one")
    return parser.parse_args()


SCRIPT_TAIL = [
    {"call": "update_crm", "args": {"contact_id": "C-1001", "note": "Refund confirmed."}, "latency": 1.0},
    {"say": "Emailed Jane and noted it."},
]


def _cluster(env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(SCRIPTED_FAULTS_ENABLED="true", SCRIPTS_FROM_USERS_ALLOWED="true", RUN_WORKER_PROCESSES="2",
               EMAIL_BACKEND="django.core.mail.backends.locmem.EmailBackend", **(env_extra or {}))
    return subprocess.Popen([sys.executable, "manage.py", "runworker"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(cluster: subprocess.Popen) -> None:
    try:
        os.killpg(cluster.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    cluster.wait(timeout=60)


def _wait_for(predicate, *, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    return None


def _chain(run_id) -> list:
    from runs.models.ledger import AgentRun

    chain = [AgentRun.objects.get(pk=run_id)]
    while (nxt := AgentRun.objects.filter(resume_of=chain[-1]).first()) is not None:
        chain.append(nxt)
    return chain


def _start(index: int):
    from runs.services import run as services

    email = {"call": "send_email", "args": {"to": f"c{index}-{uuid.uuid4().hex[:6]}@example.com",
                                             "subject": "Refund", "body": "Your refund is on its way."}}
    return services.start_run(agent_name="support", message="Email the customer.", owner_id="bench",
                              params={"script": [email, *SCRIPT_TAIL]})


def _between_two_tools(run) -> bool:
    from runs.models.ledger import ToolCall

    return ToolCall.objects.filter(run_id=run.run_id, tool_name="send_email", status="answered").exists()


def _effects_of(chain) -> tuple[int, int]:
    from agents.models import CrmNote, OutboxEmail

    ids = [r.run_id for r in chain]
    return OutboxEmail.objects.filter(run_id__in=ids).count(), CrmNote.objects.filter(run_id__in=ids).count()


def kill_workers(kills: int) -> tuple[list[float], list[dict]]:
    from django.db import connection

    seconds, rounds = [], []
    cluster = _cluster()
    try:
        for index in range(kills):
            run = _start(index)
            if not _wait_for(lambda run=run: _between_two_tools(run), seconds=120):
                rounds.append({"round": index, "outcome": "never reached the second tool"})
                continue
            from runs.models.ledger import AgentRun

            worker = AgentRun.objects.get(pk=run.pk).worker
            os.kill(int(worker.rsplit(":", 1)[1].split("/", 1)[0]), signal.SIGKILL)
            killed = time.monotonic()
            end = _wait_for(lambda run=run: (c := _chain(run.run_id))[-1].status == "success" and c, seconds=240)
            took = time.monotonic() - killed
            chain = _chain(run.run_id)
            emails, notes = _effects_of(chain)
            rounds.append({"round": index, "seconds": round(took, 2) if end else None, "runs": len(chain),
                           "finished_by_itself": bool(end), "emails": emails, "crm_notes": notes,
                           "first_verdict": f"{chain[0].status}/{chain[0].error_code}"})
            if end:
                seconds.append(took)
            print(f"  kill {index + 1}/{kills}: {rounds[-1]}", flush=True)
            connection.close()
    finally:
        _stop(cluster)
    return seconds, rounds


def lose_machines(count: int) -> tuple[list[float], list[dict]]:
    """A whole runworker dies; another one (another machine) is left: its sweep sees the locks gone."""
    from django.conf import settings

    from runs.upkeep.periodic_jobs import setup_schedules

    setup_schedules()
    seconds, rounds = [], []
    for index in range(count):
        doomed = _cluster({"WORKER_HOST": "lost"})
        try:
            run = _start(1000 + index)
            if not _wait_for(lambda run=run: _between_two_tools(run), seconds=120):
                rounds.append({"round": index, "outcome": "never reached the second tool"})
                continue
        finally:
            _stop(doomed)
        killed = time.monotonic()
        survivor = _cluster({"WORKER_HOST": "other"})
        try:
            end = _wait_for(lambda run=run: (c := _chain(run.run_id))[-1].status == "success" and c,
                            seconds=settings.RUN_STALE_AFTER_SECONDS + 240)
        finally:
            _stop(survivor)
        took = time.monotonic() - killed
        chain = _chain(run.run_id)
        emails, notes = _effects_of(chain)
        rounds.append({"round": index, "seconds": round(took, 2) if end else None, "emails": emails,
                       "crm_notes": notes, "finished_by_itself": bool(end)})
        if end:
            seconds.append(took)
        print(f"  lost machine {index + 1}/{count}: {rounds[-1]}", flush=True)
    return seconds, rounds


def fencing_price(events: int) -> dict[str, dict[str, float]]:
    """Statements, round trips and commits per function-call event + journal row, unfenced and fenced."""
    sys.path.insert(0, str(ROOT / "bench"))
    from _wire import Wire, trace_engine
    from overhead import _bench_event, _journal_run

    from agents.adk import run_coroutine, session_service

    store = run_coroutine(_service(session_service))
    wire = Wire()
    trace_engine(store.db_engine, wire)
    run_coroutine(store.db_engine.dispose())  # new connections carry the trace
    results = {}
    for key, journal_run in (("unfenced", _journal_run()), ("fenced", _journal_run(leased=True))):

        async def appends(journal_run=journal_run) -> None:
            session = await store.create_session(app_name="bench-fence", user_id="bench", session_id=str(uuid.uuid4()))
            wire.take()
            run_id, lease = journal_run
            for index in range(events):
                await store.append_event(session, _bench_event(index, run_id, lease))

        run_coroutine(appends())
        counts = wire.take()
        results[key] = {name: counts[name] / events for name in ("statements", "round_trips", "commits")}
    return results


async def _service(factory):
    return factory()


def measure(args: argparse.Namespace) -> None:
    from agents.models import Customer

    Customer.objects.get_or_create(
        email="jane@example.com", defaults={"name": "Jane Doe", "contact_id": "C-1001", "plan": "pro"}
    )
    price = fencing_price(args.events)
    print("\nPer durable event (a function call and its journal row), PostgreSQL\n")
    print_table(["append", "statements", "round trips", "commits"],
                [[key, f"{v['statements']:.2f}", f"{v['round_trips']:.2f}", f"{v['commits']:.2f}"]
                 for key, v in price.items()])

    print(f"\nSIGKILL of the worker between two tool calls, {args.kills} times (default settings)\n", flush=True)
    kill_seconds, kill_rounds = kill_workers(args.kills)
    lost_seconds, lost_rounds = lose_machines(args.lost_machine) if args.lost_machine else ([], [])

    from django.conf import settings

    kills = summary(kill_seconds) if kill_seconds else None
    lost = summary(lost_seconds) if lost_seconds else None
    table = []
    if kills:
        table.append(["worker SIGKILL → success", kills["n"], f"{kills['median']:.1f}", f"{kills['p95']:.1f}"])
    if lost:
        table.append(["lost machine → success", lost["n"], f"{lost['median']:.1f}", f"{lost['p95']:.1f}"])
    print()
    print_table(["death", "finished by itself", "s p50", "s p95"], table)
    once = all(r.get("emails") == 1 and r.get("crm_notes") == 1 for r in kill_rounds + lost_rounds if "emails" in r)
    print(f"\neach effect once in every chain: {once}")
    rows = [
        row("function call + journal row statements, fenced", price["fenced"]["statements"], "",
            peer="unfenced", peer_value=price["unfenced"]["statements"], target="≤ " + str(price["unfenced"]["statements"])),
        row("function call + journal row round trips, fenced", price["fenced"]["round_trips"], "",
            peer="unfenced", peer_value=price["unfenced"]["round_trips"]),
        row("function call + journal row commits, fenced", price["fenced"]["commits"], "",
            peer="unfenced", peer_value=price["unfenced"]["commits"]),
        row("runs finished by themselves after a worker SIGKILL", len(kill_seconds), "", target=f"= {args.kills}", correctness=True),
        row("each effect once in every chain", int(once), "", target="= 1", correctness=True),
    ]
    if kills:
        rows += [row("worker SIGKILL → success, p50", kills["median"], "s"),
                 row("worker SIGKILL → success, p95", kills["p95"], "s", target="≤ 15")]
    if lost:
        rows.append(row("lost machine → success, p95", lost["p95"], "s",
                        target=f"≤ {settings.RUN_STALE_AFTER_SECONDS + 15}"))
    save_results("recovery", rows, kills=kill_rounds, lost_machine=lost_rounds, fencing=price)


if __name__ == "__main__":
    main()
