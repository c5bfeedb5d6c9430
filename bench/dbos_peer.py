"""The durable-execution peer: DBOS Transact steps against Agent Ledger's tool journal.

The same three effects (send the email into the outbox, append the CRM note, look the customer
up) are run three ways, interleaved, on the same PostgreSQL server:

  plain      the three effects as tools run them (on the agent loop), nothing durable around them
  DBOS       a DBOS workflow of three @DBOS.step()s (checkpoint per step, per workflow)
  journal    Agent Ledger's durable call: the function-call event (with its journal row, one
             transaction) stored before the effect, the function-response event (which marks the
             call answered) after it, in an ADK session created for the unit

Printed: ms per 3-effect unit for each, and the durability cost per step / per journaled call
(contender minus plain, divided by 3).

    pip install -r bench/requirements.txt
    python bench/dbos_peer.py [--units 300] [--warmup 30]
"""

from __future__ import annotations

import argparse
import asyncio
import uuid

from _benchdb import PREFIX, bench_database
from _common import interleaved, print_table, save_results, summary

DBOS_SYSTEM_DATABASE = f"{PREFIX}dbos_sys"


def main() -> None:
    args = parse_args()
    with bench_database('dbos_app'):
        measure(args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--block", type=int, default=10)
    return parser.parse_args()


def measure(args: argparse.Namespace) -> None:
    from _benchdb import database_url, drop_database
    from asgiref.sync import sync_to_async
    from dbos import DBOS
    from google.adk.events.event import Event
    from google.genai import types

    from agents.adk import run_coroutine, session_service
    from agents.models import CrmNote, Customer, OutboxEmail
    from runs.models.ledger import AgentRun, ToolCall, ToolCallStatus

    async def _service():
        return session_service()

    Customer.objects.get_or_create(
        email="jane@example.com", defaults={"name": "Jane Doe", "contact_id": "C-1001", "plan": "pro"}
    )

    def send_email_effect(run_id):
        return OutboxEmail.objects.create(run_id=run_id, to="jane@example.com", subject="Refund", body="On its way.").pk

    def update_crm_effect(run_id):
        return CrmNote.objects.create(run_id=run_id, contact_id="C-1001", note="Refund confirmed.").pk

    def lookup_effect(run_id):
        return Customer.objects.filter(email="jane@example.com").values_list("contact_id", flat=True).first()

    effects = [("send_email", send_email_effect), ("update_crm", update_crm_effect), ("lookup_customer", lookup_effect)]

    drop_database(DBOS_SYSTEM_DATABASE)
    system_url = database_url(DBOS_SYSTEM_DATABASE).replace("postgres://", "postgresql://", 1)
    DBOS(config={"name": "agent-ledger-peer", "system_database_url": system_url})

    @DBOS.step()
    def send_email_step(run_id: str):
        return send_email_effect(uuid.UUID(run_id))

    @DBOS.step()
    def update_crm_step(run_id: str):
        return update_crm_effect(uuid.UUID(run_id))

    @DBOS.step()
    def lookup_step(run_id: str):
        return lookup_effect(uuid.UUID(run_id))

    @DBOS.workflow()
    def support_workflow(run_id: str):
        send_email_step(run_id)
        update_crm_step(run_id)
        return lookup_step(run_id)

    DBOS.launch()

    async def plain_async(run_id) -> None:
        # Tools run on the agent loop and reach the ORM through the same thread hop.
        for _, effect in effects:
            await sync_to_async(effect)(run_id)

    def plain() -> None:
        run_coroutine(plain_async(uuid.uuid4()))

    def dbos_unit() -> None:
        support_workflow(str(uuid.uuid4()))

    sessions = run_coroutine(_service())

    async def journaled_async(run_id, *, journal: bool = True) -> None:
        session_id = str(uuid.uuid4())
        session = await sessions.create_session(app_name="support", user_id="bench", session_id=session_id)
        # Without a run id on the events the journal hook has nothing to write: the same event
        # store, minus the journal, isolates what the journal itself adds.
        metadata = {"run_id": str(run_id)} if journal else {}
        invocation_id = f"e-{run_id}"
        for name, effect in effects:
            call_id = f"call-{uuid.uuid4().hex[:12]}"
            call = types.Part(function_call=types.FunctionCall(id=call_id, name=name, args={}))
            await sessions.append_event(
                session,
                Event(invocation_id=invocation_id, author="support", custom_metadata=metadata,
                      content=types.Content(role="model", parts=[call])),
            )
            result = await sync_to_async(effect)(run_id)
            answer = types.Part(function_response=types.FunctionResponse(id=call_id, name=name, response={"result": result}))
            await sessions.append_event(
                session,
                Event(invocation_id=invocation_id, author="support", custom_metadata=metadata,
                      content=types.Content(role="user", parts=[answer])),
            )

    def journaled() -> None:
        run = AgentRun.objects.create(agent_name="support", owner_id="bench", config={"message": "x"}, session_id=str(uuid.uuid4()))
        run_coroutine(journaled_async(run.run_id))
        journaled_calls = ToolCall.objects.filter(run=run, status=ToolCallStatus.ANSWERED).count()
        if journaled_calls != len(effects):
            raise SystemExit(f"expected {len(effects)} answered journal rows, found {journaled_calls}")

    def events_only() -> None:
        run_coroutine(journaled_async(uuid.uuid4(), journal=False))

    def journaled_cost_of_row() -> None:
        """The AgentRun row above is the ledger's, not the journal's: time it to subtract it."""
        AgentRun.objects.create(agent_name="support", owner_id="bench", config={"message": "x"}, session_id=str(uuid.uuid4()))

    contenders = {
        "plain": plain,
        "DBOS workflow": dbos_unit,
        "journal": journaled,
        "events only": events_only,
        "run row only": journaled_cost_of_row,
    }
    timings = interleaved(contenders, count=args.units, block=args.block, warmup=args.warmup)
    DBOS.destroy()

    stats = {key: summary(values) for key, values in timings.items()}
    plain_ms = stats["plain"]["median"]
    dbos_per_step = (stats["DBOS workflow"]["median"] - plain_ms) / 3
    journal_per_call = (stats["journal"]["median"] - stats["run row only"]["median"] - plain_ms) / 3
    print(f"\n{args.units} units of three effects per contender, interleaved, PostgreSQL\n")
    print_table(
        ["contender", "ms/unit p50", "ms/unit p95"],
        [[key, f"{s['median']:.2f}", f"{s['p95']:.2f}"] for key, s in stats.items()],
    )
    print(f"\nDBOS: {dbos_per_step:.2f} ms per step above the bare effect "
          f"({stats['DBOS workflow']['median']:.2f} ms per 3-step workflow)")
    print(f"Agent Ledger: {journal_per_call:.2f} ms per durable call (call event + journal row before, answer after) above the bare effect")
    journal_only = (stats["journal"]["median"] - stats["run row only"]["median"] - stats["events only"]["median"]) / 3
    print(f"   of which the journal rows themselves: {journal_only:.2f} ms per call (the rest is ADK's event store)")
    print(f"ratio Agent Ledger/DBOS per call: {journal_per_call / dbos_per_step:.2f}")
    save_results(
        "dbos_peer",
        [
            {"metric": "DBOS ms per step (over bare effect)", "value": dbos_per_step, "unit": "ms"},
            {"metric": "DBOS ms per 3-step workflow", "value": stats["DBOS workflow"]["median"], "unit": "ms"},
            {"metric": "Agent Ledger ms per durable call (over bare effect)", "value": journal_per_call, "unit": "ms",
             "peer": "DBOS step", "ratio": journal_per_call / dbos_per_step},
            {"metric": "journal rows alone, ms per call", "value": journal_only, "unit": "ms"},
        ],
        stats=stats,
    )
    drop_database(DBOS_SYSTEM_DATABASE)


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
