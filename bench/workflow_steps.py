"""What recording a workflow costs per run, against the same ADK Workflow run bare.

The demo workflow (`refund_review`: triage and billing fanned out, a join, a function step,
then support: 5 steps, 5 tool calls) on the scripted model, on PostgreSQL, two contenders
interleaved block by block on the same long-lived event loop:

  (a) the compiled ADK Workflow on ADK's runner + DatabaseSessionService, steps reported to a
      recorder that does nothing
  (b) a full Agent Ledger workflow run in-process: row, claim, journal, a RunStep row per step
      (step_start, step_complete), heartbeat, settle

    python bench/workflow_steps.py [--runs 60] [--warmup 5] [--block 5]
"""

from __future__ import annotations

import argparse
import time
import uuid

from _benchdb import bench_database
from _common import print_table, save_results, summary


class NoRecorder:
    async def started(self, **kwargs) -> None:
        return None

    async def finished(self, **kwargs) -> None:
        return None

    async def failed(self, **kwargs) -> None:
        return None

    async def cancelled(self, **kwargs) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=60, help="timed runs per contender")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per contender first")
    parser.add_argument("--block", type=int, default=5, help="runs per contender before switching")
    args = parser.parse_args()
    if min(args.runs, args.block) < 1 or args.warmup < 0:
        parser.error("--runs and --block must be positive, --warmup not negative")
    with bench_database("workflow_steps"):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    from google.adk.apps import App
    from google.adk.runners import Runner
    from google.genai import types

    from agents.adk import run_coroutine, session_service
    from agents.demo import DEMO_WORKFLOW
    from agents.models import Customer
    from agents.services import save_workflow, workflow_snapshot
    from agents.workflows import compile_workflow
    from runs.execution import executor
    from runs.management.commands.seed_demo import DEMO_CUSTOMERS
    from runs.models.ledger import AgentRun, RunStatus, RunStep
    from runs.services import run as services

    for customer in DEMO_CUSTOMERS:
        Customer.objects.get_or_create(email=customer["email"], defaults=customer)
    save_workflow(**DEMO_WORKFLOW)
    snap = workflow_snapshot(DEMO_WORKFLOW["name"])
    message = types.Content(role="user", parts=[types.Part(text="Jane asks where her refund is.")])

    async def bare_once() -> None:
        app = App(name="refund_review", root_agent=compile_workflow(snap, params={}, recorder=NoRecorder()))
        sessions = session_service()
        session_id = str(uuid.uuid4())
        await sessions.create_session(app_name="refund_review", user_id="bench", session_id=session_id)
        runner = Runner(app=app, session_service=sessions)
        try:
            async for _event in runner.run_async(user_id="bench", session_id=session_id, new_message=message):
                pass
        finally:
            await runner.close()

    def bare() -> None:
        run_coroutine(bare_once())

    def ledger() -> None:
        run = services.start_run(
            agent_name="refund_review", message="Jane asks where her refund is.", owner_id="bench", enqueue=False
        )
        executor.execute(run.run_id)

    contenders = {"bare ADK Workflow": bare, "Agent Ledger workflow run": ledger}
    for _ in range(args.warmup):
        for work in contenders.values():
            work()
    timings: dict[str, list[float]] = {name: [] for name in contenders}
    while min(len(t) for t in timings.values()) < args.runs:
        for name, work in contenders.items():
            for _ in range(args.block):
                started = time.perf_counter()
                work()
                timings[name].append((time.perf_counter() - started) * 1000)

    ledger_runs = AgentRun.objects.filter(agent_name="refund_review")
    assert not ledger_runs.exclude(status=RunStatus.SUCCESS).exists(), "a benchmark run did not succeed"
    steps_per_run = RunStep.objects.count() / ledger_runs.count()

    stats = {name: summary(values) for name, values in timings.items()}
    bare_median = stats["bare ADK Workflow"]["median"]
    ledger_median = stats["Agent Ledger workflow run"]["median"]
    print(f"refund_review: 5 steps, 5 tool calls per run; {args.runs} runs per contender; "
          f"{steps_per_run:g} RunStep rows per ledger run")
    print_table(
        ["contender", "median ms", "p95 ms", "mean ms"],
        [[name, f"{s['median']:.1f}", f"{s['p95']:.1f}", f"{s['mean']:.1f}"] for name, s in stats.items()],
    )
    print(f"ratio (ledger / bare, medians): {ledger_median / bare_median:.2f}x; "
          f"+{ledger_median - bare_median:.1f} ms per run (row, claim, journal, steps, heartbeat, settle, memory)")
    save_results(
        "workflow_steps",
        [
            {"metric": "workflow run median", "value": round(ledger_median, 2), "unit": "ms",
             "peer": "bare ADK Workflow", "peer_value": round(bare_median, 2),
             "ratio": round(ledger_median / bare_median, 3), "target": None},
        ],
        stats=stats,
    )


if __name__ == "__main__":
    main()
