"""What durability costs per run, against the ADK runner alone.

Per event first: one `append_event` through ADK's stock DatabaseSessionService (as ADK builds it
for a URL: pre-ping on) and through Agent Ledger's SessionStore, on the same database, in
alternating blocks.

Then per run: the `support` agent's default script (3 tool calls, then an answer) on the
scripted model, on PostgreSQL, four contenders interleaved block by block:

  (a)  ADK runner + InMemorySessionService
  (b)  ADK runner + ADK's stock DatabaseSessionService on the same database
  (b') ADK runner + SessionStore, the session service Agent Ledger runs on
  (c)  a full Agent Ledger run in-process: row, claim, journal, heartbeat, settle (and whatever
       else the executor does on success)

All of them use the same agent, the same tools (which write their outbox / CRM rows), the
same long-lived event loop and the same memories: the agent preloads memory, so every contender
has a memory service holding the same ten memories of the bench's owner, each matching the
bench's message ((a), (b), (b'): ADK's InMemoryMemoryService; (c): the ledger's, in the
database). What a (c) run feeds into memory is removed after it, untimed, so the memories do
not grow over the benchmark. Beside wall time, CPU per run: this process's (every thread) and
the PostgreSQL backends' of the benchmark's database (utime + stime from /proc, summed over each
block; a backend that exits within a block loses its last part, which only ever lowers (c)). A separate accounting pass reads libpq's protocol trace of every
connection (SQLAlchemy's and Django's) to count statements, round trips and commits exactly,
and times where the time of (c) goes.

    python bench/overhead.py [--runs 200] [--warmup 20] [--block 10] [--events 400]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections import defaultdict

from _benchdb import bench_database
from _common import print_table, save_results, summary
from _wire import Wire, trace_django, trace_engine

TOOL_CALLS_PER_RUN = 3


def main() -> None:
    args = parse_args()
    with bench_database('overhead'):
        measure(args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="timed runs per contender")
    parser.add_argument("--warmup", type=int, default=20, help="untimed runs per contender first")
    parser.add_argument("--block", type=int, default=10, help="runs per contender before switching")
    parser.add_argument("--accounting-runs", type=int, default=30)
    parser.add_argument("--events", type=int, default=400, help="timed appends per session service")
    args = parser.parse_args()
    if min(args.runs, args.block, args.accounting_runs, args.events) < 1 or args.warmup < 0:
        parser.error("--runs, --block, --events and --accounting-runs must be positive, --warmup not negative")
    return args


def measure(args: argparse.Namespace) -> None:
    from google.adk.apps import App
    from google.adk.memory import InMemoryMemoryService
    from google.adk.runners import Runner
    from google.adk.sessions import InMemorySessionService
    from google.adk.sessions.database_session_service import DatabaseSessionService
    from google.genai import types
    from sqlalchemy.ext.asyncio import create_async_engine

    from agents.adk import adk_database_url, create_adk_engine, run_coroutine, session_service
    from agents.models import Customer
    from agents.registry import build_agent, get_agent_spec
    from agents.session_store import SessionStore
    from memory.adk import memory_service
    from memory.models import MemoryEntry
    from runs.execution import executor
    from runs.services import run as services

    Customer.objects.get_or_create(
        email="jane@example.com", defaults={"name": "Jane Doe", "contact_id": "C-1001", "plan": "pro"}
    )
    spec = get_agent_spec("support")
    message = types.Content(role="user", parts=[types.Part(text="Jane asks where her refund is.")])
    in_memory = InMemorySessionService()
    adk_memory = InMemoryMemoryService()
    run_coroutine(_seed_memories(spec.name, [adk_memory, memory_service()]))

    async def adk_run(sessions) -> None:
        runner = Runner(
            app=App(name=spec.name, root_agent=build_agent(spec, params={})),
            session_service=sessions,
            memory_service=adk_memory,
        )
        session_id = str(uuid.uuid4())
        await sessions.create_session(app_name=spec.name, user_id="bench", session_id=session_id)
        async for _ in runner.run_async(user_id="bench", session_id=session_id, new_message=message):
            pass
        await runner.close()

    async def services_on_this_loop():
        # ADK's stock service as ADK builds it from a URL (pre-ping on), with the same pool
        # size as Agent Ledger's; the store is the one every Agent Ledger run uses.
        from django.conf import settings

        stock_engine = create_async_engine(
            adk_database_url(),
            pool_size=settings.ADK_DB_POOL_SIZE,
            max_overflow=settings.ADK_DB_MAX_OVERFLOW,
            pool_recycle=settings.ADK_DB_POOL_RECYCLE_SECONDS,
            pool_pre_ping=True,
        )
        # The same store with every commit waiting for the disk: what EVENT_COMMITS_MAY_LAG saves.
        strict = SessionStore(db_engine=create_adk_engine(), lagging_commits=False)
        return DatabaseSessionService(db_engine=stock_engine), session_service(), strict

    stock_sessions, store_sessions, strict_sessions = run_coroutine(services_on_this_loop())
    stores = {"stock": stock_sessions, "store": store_sessions, "strict": strict_sessions}
    store_labels = {
        "stock": "ADK DatabaseSessionService (pre-ping)",
        "store": "SessionStore (compare-and-set)",
        "strict": "SessionStore, synchronous_commit on for every event",
        "journal": "SessionStore, function call + journal row",
        "fenced": "SessionStore, function call + journal row, fenced by the run's lease",
    }

    def run_a() -> None:
        run_coroutine(adk_run(in_memory))

    def run_b() -> None:
        run_coroutine(adk_run(stock_sessions))

    def run_b_prime() -> None:
        run_coroutine(adk_run(store_sessions))

    def run_c() -> None:
        run = services.start_run(
            agent_name=spec.name, message="Jane asks where her refund is.", owner_id="bench", enqueue=False
        )
        status = executor.execute(run.run_id)
        if status != "success":
            raise SystemExit(f"an Agent Ledger run ended {status}; the benchmark is void")
        return run.run_id

    def forget_c(run_id) -> None:
        # Untimed: the memories stay the seeded ten.
        MemoryEntry.objects.filter(run_id=run_id).delete()

    contenders = {"a": run_a, "b": run_b, "b'": run_b_prime, "c": run_c}
    labels = {
        "a": "ADK runner + InMemorySessionService",
        "b": "ADK runner + ADK DatabaseSessionService",
        "b'": "ADK runner + SessionStore",
        "c": "Agent Ledger run (in-process)",
    }

    event_timings = time_events(stores, args, run_coroutine)

    load_before = os.getloadavg()
    timings, cpu = interleaved_with_cpu(
        contenders, count=args.runs, block=args.block, warmup=args.warmup, after={"c": forget_c}
    )
    load_after = os.getloadavg()

    def run_c_and_forget() -> None:
        forget_c(run_c())

    contenders["c"] = run_c_and_forget
    # Timed before any tracing: libpq's trace writes a line per protocol message.
    breakdown = time_parts(run_c_and_forget, args.accounting_runs, store_sessions)
    wires = {"stock": Wire(), "store": Wire(), "django": Wire()}
    wires["strict"] = Wire()
    for name in ("stock", "store", "strict"):
        trace_engine(stores[name].db_engine, wires[name])
        run_coroutine(stores[name].db_engine.dispose())
    trace_django(wires["django"])
    event_accounting = account_events(stores, wires, args.accounting_runs * 4, run_coroutine)
    accounting = account_runs(contenders, wires, args.accounting_runs)
    accounting["c"]["breakdown"] = breakdown

    event_stats = {key: summary(values) for key, values in event_timings.items()}
    print(f"\nPer event: append_event, {args.events} appends per service (alternating blocks), PostgreSQL\n")
    print_table(
        ["session service", "ms p50", "ms p95", "statements", "round trips", "commits", "lagging commits"],
        [
            [
                store_labels[key],
                f"{event_stats[key]['median']:.2f}",
                f"{event_stats[key]['p95']:.2f}",
                f"{event_accounting[key]['statements']:.1f}",
                f"{event_accounting[key]['round_trips']:.1f}",
                f"{event_accounting[key]['commits']:.1f}",
                f"{event_accounting[key]['lagging_commits']:.1f}",
            ]
            for key in store_labels
        ],
    )

    stats = {key: summary(values) for key, values in timings.items()}
    print(f"\nPer run, {args.runs} runs per contender (interleaved in blocks of {args.block}), PostgreSQL\n")
    rows = []
    for key in contenders:
        s, acc = stats[key], accounting[key]
        rows.append(
            [
                f"({key}) {labels[key]}",
                f"{s['median']:.1f}",
                f"{s['p95']:.1f}",
                f"{s['median'] / TOOL_CALLS_PER_RUN:.1f}",
                f"{acc['commits']:.1f}",
                f"{acc['commits'] - acc['lagging_commits']:.1f}",
                f"{acc['statements']:.1f}",
                f"{acc['round_trips']:.1f}",
            ]
        )
    print_table(
        ["contender", "ms/run p50", "ms/run p95", "ms/tool call", "commits/run", "of them waiting for the disk",
         "statements/run", "round trips/run"],
        rows,
    )
    print("\nThe same per stored event (every connection's work divided by the events the run stores):\n")
    print_table(
        ["contender", "events/run", "commits/event", "statements/event", "round trips/event"],
        [
            [f"({key}) {labels[key]}", f"{accounting[key]['events']:.1f}"]
            + (
                [f"{accounting[key][name] / accounting[key]['events']:.2f}" for name in ("commits", "statements", "round_trips")]
                if accounting[key]["events"]
                else ["–", "–", "–"]
            )
            for key in contenders
        ],
    )

    print("\nCPU per run (ms): this process (every thread) and the PostgreSQL backends, summed per block\n")
    print_table(
        ["contender", "wall p50", "process CPU", "PostgreSQL CPU", "CPU total", "CPU / (a)'s"],
        [
            [
                f"({key}) {labels[key]}",
                f"{stats[key]['median']:.1f}",
                f"{cpu[key]['process']:.1f}",
                f"{cpu[key]['postgres']:.1f}",
                f"{cpu[key]['total']:.1f}",
                f"{cpu[key]['total'] / cpu['a']['total']:.2f}",
            ]
            for key in contenders
        ],
    )
    print(f"load average (1, 5, 15 min) before: {_load(load_before)}, after: {_load(load_after)}")

    ratios = {
        "b/a": stats["b"]["median"] / stats["a"]["median"],
        "b'/a": stats["b'"]["median"] / stats["a"]["median"],
        "c/b'": stats["c"]["median"] / stats["b'"]["median"],
        "c/a": stats["c"]["median"] / stats["a"]["median"],
        "CPU c/a": cpu["c"]["total"] / cpu["a"]["total"],
    }
    ledger_statements_per_call = (accounting["c"]["statements"] - accounting["b'"]["statements"]) / TOOL_CALLS_PER_RUN
    print()
    for name, value in ratios.items():
        print(f"{name:7} = {value:.2f}")
    print("c/a target ≤ 2.5 (moonshot 2.0); CPU c/a target ≤ 2")
    print(f"ledger + journal statements per tool call, (c − b') / {TOOL_CALLS_PER_RUN}: {ledger_statements_per_call:.1f}")

    print("\nStatements per run by connection (accounting pass):")
    print_table(
        ["contender", "ADK stock engine", "SessionStore engine", "Django"],
        [
            [f"({key})"] + [f"{accounting[key]['by_source'][name]:.1f}" for name in ("stock", "store", "django")]
            for key in contenders
        ],
    )
    print("\nWhere the time of one Agent Ledger run goes (a separate untraced pass, ms per run):")
    print_table(
        ["part", "ms/run", "calls/run"],
        [[part, f"{ms:.2f}", f"{calls:.1f}"] for part, (ms, calls) in breakdown.items()],
    )

    save_results(
        "overhead",
        [
            {"metric": "append_event p50, ADK DatabaseSessionService", "value": event_stats["stock"]["median"], "unit": "ms"},
            {
                "metric": "append_event p50, SessionStore",
                "value": event_stats["store"]["median"],
                "unit": "ms",
                "peer": "ADK DatabaseSessionService",
                "peer_value": event_stats["stock"]["median"],
                "ratio": event_stats["store"]["median"] / event_stats["stock"]["median"],
                "target": "≤ 1.5",
            },
            {
                "metric": "append_event p50, SessionStore, synchronous_commit off (model turn)",
                "value": event_stats["store"]["median"],
                "unit": "ms",
                "peer": "synchronous_commit on",
                "peer_value": event_stats["strict"]["median"],
            },
            {"metric": "append_event statements, SessionStore", "value": event_accounting["store"]["statements"], "unit": ""},
            {"metric": "append_event round trips, SessionStore", "value": event_accounting["store"]["round_trips"], "unit": ""},
            {
                "metric": "function call + journal row statements, SessionStore",
                "value": event_accounting["journal"]["statements"],
                "unit": "",
                "target": "≤ 3",
            },
            {
                "metric": "function call + journal row statements, fenced by the run's lease",
                "value": event_accounting["fenced"]["statements"],
                "unit": "",
                "peer": "unfenced",
                "peer_value": event_accounting["journal"]["statements"],
                "target": "no extra round trip",
            },
            {
                "metric": "function call + journal row round trips, fenced by the run's lease",
                "value": event_accounting["fenced"]["round_trips"],
                "unit": "",
                "peer": "unfenced",
                "peer_value": event_accounting["journal"]["round_trips"],
            },
            {"metric": "(a) ms/run, ADK + in-memory sessions", "value": stats["a"]["median"], "unit": "ms"},
            {"metric": "(b) ms/run, ADK + DatabaseSessionService", "value": stats["b"]["median"], "unit": "ms"},
            {"metric": "(b') ms/run, ADK + SessionStore", "value": stats["b'"]["median"], "unit": "ms"},
            {"metric": "(c) ms/run, Agent Ledger", "value": stats["c"]["median"], "unit": "ms"},
            {"metric": "c/b'", "value": ratios["c/b'"], "unit": "ratio"},
            {"metric": "c/a", "value": ratios["c/a"], "unit": "ratio", "target": "≤ 2.5 (moonshot 2.0)"},
            {"metric": "(a) CPU ms/run, process + PostgreSQL", "value": cpu["a"]["total"], "unit": "ms"},
            {"metric": "(c) CPU ms/run, process + PostgreSQL", "value": cpu["c"]["total"], "unit": "ms"},
            {"metric": "CPU c/a", "value": ratios["CPU c/a"], "unit": "ratio", "target": "≤ 2"},
            {"metric": "(b) commits/run", "value": accounting["b"]["commits"], "unit": ""},
            {"metric": "(c) commits/run", "value": accounting["c"]["commits"], "unit": "", "target": "≤ 12 (moonshot 8)"},
            {"metric": "(c) round trips/run", "value": accounting["c"]["round_trips"], "unit": ""},
            {
                "metric": "(c) commits/run waiting for the disk (synchronous_commit on)",
                "value": accounting["c"]["commits"] - accounting["c"]["lagging_commits"],
                "unit": "",
            },
            {"metric": "(b) round trips/run", "value": accounting["b"]["round_trips"], "unit": ""},
            {
                "metric": "(c) commits per stored event",
                "value": accounting["c"]["commits"] / (accounting["c"]["events"] or 1),
                "unit": "",
            },
            {"metric": "(b) statements/run", "value": accounting["b"]["statements"], "unit": ""},
            {"metric": "(c) statements/run", "value": accounting["c"]["statements"], "unit": ""},
            {
                "metric": "ledger + journal statements per tool call",
                "value": ledger_statements_per_call,
                "unit": "",
                "target": "≤ 3",
            },
        ],
        event_stats=event_stats,
        event_accounting=event_accounting,
        stats=stats,
        cpu=cpu,
        load_average={"before": load_before, "after": load_after},
        accounting=accounting,
    )


SEEDED_MEMORIES = 10


async def _seed_memories(app_name: str, services: list) -> None:
    """The same memories of the bench's owner in every memory service, each matching its message."""
    from google.adk.events.event import Event
    from google.genai import types

    events = [
        Event(
            invocation_id="e-seed",
            author="user",
            content=types.Content(
                role="user", parts=[types.Part(text=f"Jane asked about her refund, order {1000 + index}.")]
            ),
        )
        for index in range(SEEDED_MEMORIES)
    ]
    for service in services:
        await service.add_events_to_memory(app_name=app_name, user_id="bench", events=events, session_id="seed")


def _load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{value:.2f}" for value in load)


class _BackendCpu:
    """CPU (ms) the benchmark database's PostgreSQL backends have used, from /proc/<pid>/stat."""

    def __init__(self) -> None:
        import psycopg
        from django.db import connection

        settings = connection.settings_dict
        self.conn = psycopg.connect(
            host=settings["HOST"] or None, port=settings["PORT"] or None, user=settings["USER"],
            password=settings["PASSWORD"] or None, dbname=settings["NAME"], autocommit=True,
        )
        self.tick_ms = 1000 / os.sysconf("SC_CLK_TCK")

    def sample(self) -> dict[int, float]:
        pids = [
            row[0]
            for row in self.conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        ]
        used = {}
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone since the query
            used[pid] = (int(fields[11]) + int(fields[12])) * self.tick_ms
        return used

    @staticmethod
    def spent(before: dict[int, float], after: dict[int, float]) -> float:
        return sum(value - before.get(pid, 0.0) for pid, value in after.items())


def interleaved_with_cpu(
    contenders: dict, *, count: int, block: int, warmup: int, after: dict | None = None
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Wall ms per run of each contender, interleaved in blocks (as `_common.interleaved`), and
    CPU ms per run: this process's and the PostgreSQL backends', measured around each block.

    `after[key]`, untimed, gets what the contender's run returned (cleaning up behind it).
    """
    after = after or {}
    for _ in range(warmup):
        for key, run in contenders.items():
            result = run()
            if key in after:
                after[key](result)
    backends = _BackendCpu()
    timings: dict[str, list[float]] = {key: [] for key in contenders}
    spent = {key: {"process": 0.0, "postgres": 0.0} for key in contenders}
    done = 0
    while done < count:
        turn = min(block, count - done)
        for key, run in contenders.items():
            results = []
            pg_before, cpu_before = backends.sample(), time.process_time()
            for _ in range(turn):
                started = time.perf_counter()
                results.append(run())
                timings[key].append((time.perf_counter() - started) * 1000)
            cpu_after = time.process_time()
            spent[key]["postgres"] += backends.spent(pg_before, backends.sample())
            spent[key]["process"] += (cpu_after - cpu_before) * 1000
            for result in results:
                if key in after:
                    after[key](result)
        done += turn
    backends.conn.close()
    cpu = {
        key: {
            "process": values["process"] / count,
            "postgres": values["postgres"] / count,
            "total": (values["process"] + values["postgres"]) / count,
        }
        for key, values in spent.items()
    }
    return timings, cpu


def _bench_event(index: int, run_id: uuid.UUID | None = None, lease: uuid.UUID | None = None):
    from google.adk.events.event import Event
    from google.genai import types

    if run_id is not None:
        # A function call of a ledger run: the journal writes its row in the event's transaction.
        call = types.FunctionCall(id=f"call-{uuid.uuid4().hex[:12]}", name="send_email", args={"to": "jane@example.com"})
        return Event(
            invocation_id="e-bench",
            author="support",
            custom_metadata={"run_id": str(run_id), **({"lease": str(lease)} if lease else {})},
            content=types.Content(role="model", parts=[types.Part(function_call=call)]),
        )
    # A model turn the size of the scripted agent's: text, no state delta, no function call.
    text = f"Step {index}: Jane's refund was issued on Monday and should arrive within five days."
    return Event(invocation_id="e-bench", author="support", content=types.Content(role="model", parts=[types.Part(text=text)]))


def _journal_run(*, leased: bool = False) -> tuple[uuid.UUID, uuid.UUID | None]:
    """A run to journal calls for; `leased`: running under a lease, so every append is fenced."""
    from runs.models.ledger import AgentRun

    lease = uuid.uuid4() if leased else None
    run = AgentRun.objects.create(
        agent_name="support", owner_id="bench", config={"message": "x"}, session_id=str(uuid.uuid4()),
        status="running" if leased else "queued", lease=lease,
    )
    return run.run_id, lease


async def _append_many(service, count: int, journal_run: tuple | None = None) -> list[float]:
    session = await service.create_session(app_name="bench-events", user_id="bench", session_id=str(uuid.uuid4()))
    timings = []
    run_id, lease = journal_run or (None, None)
    for index in range(count):
        event = _bench_event(index, run_id, lease)
        started = time.perf_counter()
        await service.append_event(session, event)
        timings.append((time.perf_counter() - started) * 1000)
    return timings


def time_events(stores: dict, args: argparse.Namespace, run_coroutine) -> dict[str, list[float]]:
    """ms per append_event, timed on the loop itself (no thread hop in the figure)."""
    block = 20
    contenders = {key: (service, None) for key, service in stores.items()}
    contenders["journal"] = (stores["store"], _journal_run())
    contenders["fenced"] = (stores["store"], _journal_run(leased=True))
    for service, journal_run in contenders.values():
        run_coroutine(_append_many(service, 50, journal_run))
    timings: dict[str, list[float]] = defaultdict(list)
    while len(timings["store"]) < args.events:
        for key, (service, journal_run) in contenders.items():
            timings[key].extend(run_coroutine(_append_many(service, block, journal_run)))
    return timings


def account_events(stores: dict, wires: dict, count: int, run_coroutine) -> dict[str, dict[str, float]]:
    results = {}
    async def appends(service, wire: Wire, journal_run: tuple | None) -> None:
        session = await service.create_session(app_name="bench-events", user_id="bench", session_id=str(uuid.uuid4()))
        wire.take()
        run_id, lease = journal_run or (None, None)
        for index in range(count):
            await service.append_event(session, _bench_event(index, run_id, lease))

    for key, wire_name, service, journal_run in [
        ("stock", "stock", stores["stock"], None),
        ("store", "store", stores["store"], None),
        ("strict", "strict", stores["strict"], None),
        ("journal", "store", stores["store"], _journal_run()),
        ("fenced", "store", stores["store"], _journal_run(leased=True)),
    ]:
        run_coroutine(appends(service, wires[wire_name], journal_run))
        counts = wires[wire_name].take()
        results[key] = {
            name: counts[name] / count for name in ("statements", "round_trips", "commits", "lagging_commits")
        }
    return results


def time_parts(run_c, runs: int, store_sessions) -> dict[str, tuple[float, float]]:
    """Where the time of (c) goes: the session store's calls and the ledger's own steps."""
    from runs.ledger import lifecycle
    from runs.services import run as services

    store_class = type(store_sessions)
    timers: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])

    def timed(owner, name: str, label: str):
        original = getattr(owner, name)

        if asyncio.iscoroutinefunction(original):

            async def wrapper(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    timers[label][0] += (time.perf_counter() - started) * 1000
                    timers[label][1] += 1
        else:

            def wrapper(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    timers[label][0] += (time.perf_counter() - started) * 1000
                    timers[label][1] += 1

        setattr(owner, name, wrapper)
        return owner, name, original

    restore = [
        # The journal's rows are written inside append_event's own transaction.
        timed(store_class, "append_event", "session store + journal: append_event"),
        timed(store_class, "get_session", "session store: get_session"),
        timed(store_class, "create_session", "session store: create_session"),
        timed(services, "start_run", "ledger: start_run"),
        timed(lifecycle, "claim_and_load_run", "ledger: claim"),
        timed(lifecycle, "settle_run", "ledger: settle"),
        timed(executor_module(), "_remember", "ledger: memory feed"),
    ]
    started = time.perf_counter()
    try:
        for _ in range(runs):
            run_c()
    finally:
        for owner, name, original in restore:
            setattr(owner, name, original)
    total_ms = (time.perf_counter() - started) * 1000
    breakdown = {label: (ms / runs, calls / runs) for label, (ms, calls) in sorted(timers.items())}
    measured = sum(ms for ms, _ in breakdown.values())
    breakdown["ADK itself, tools and the rest"] = (total_ms / runs - measured, 0.0)
    return breakdown


def executor_module():
    from runs.execution import executor

    return executor


def _stored_events() -> int:
    from agents.models import AdkEvent

    return AdkEvent.objects.count()


def account_runs(contenders: dict, wires: dict, runs: int) -> dict:
    """Statements, round trips and commits per run, from every connection's protocol trace.

    Also the events each run stores (none for the in-memory sessions), for the per-event figures;
    counting them is read after the wires are taken, so it is not in the figures.
    """
    results = {}
    for key, run in contenders.items():
        events_before = _stored_events()
        for wire in wires.values():
            wire.take()
        for _ in range(runs):
            run()
        # A heartbeat thread may still be closing its connection: let its last lines land.
        time.sleep(0.2)
        by_wire = {name: wire.take() for name, wire in wires.items()}
        totals = {
            name: sum(counts[name] for counts in by_wire.values()) / runs
            for name in ("statements", "round_trips", "commits", "lagging_commits")
        }
        results[key] = {
            **totals,
            "events": (_stored_events() - events_before) / runs,
            "by_source": {name: counts["statements"] / runs for name, counts in by_wire.items()},
        }
    return results


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
