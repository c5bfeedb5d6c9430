"""Cancelling runs: a queued run never starts; a running one stops within a few heartbeats."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from agents.models import AdkEvent, CrmNote
from runs.execution import executor
from runs.execution.executor import execute as execute_run
from runs.ledger import lifecycle
from runs.models.ledger import AgentRun, RunStatus, ToolCallStatus
from runs.refusals import RunAlreadySettled, RunNotFound
from runs.rules import replay as rules
from runs.services import run as services
from tests.helpers import LOOKUP, SAY_DONE, UPDATE_CRM, script_params

# A run cancelled from the test is running on the agent loop's threads and connections.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed


@committed
def test_a_queued_run_that_is_cancelled_never_starts(alice):
    run = services.start_run(
        agent_name="support", message="hi", owner_id="jane", created_by=alice,
        params=script_params(UPDATE_CRM, SAY_DONE), enqueue=False,
    )
    cancelled = services.cancel_run(run.run_id, actor=alice)

    assert cancelled.status == RunStatus.CANCELLED
    assert cancelled.tools_executed == []
    assert cancelled.cancel_requested_by == alice
    assert cancelled.finished_at is not None
    assert cancelled.error_code == "cancelled"

    # The worker's task arrives anyway: it finds nothing to claim.
    assert execute_run(str(run.run_id)) == "not claimed"
    cancelled.refresh_from_db()
    assert cancelled.status == RunStatus.CANCELLED
    assert cancelled.attempts == 0
    assert CrmNote.objects.count() == 0
    assert not AdkEvent.objects.filter(session_id=run.session_id).exists()
    # Nothing ran, so it is replayable as it stands.
    assert rules.decide(cancelled, force=False).allowed


@committed
def test_a_running_run_is_cancelled_within_a_few_heartbeats_with_its_calls_recorded(settings, alice):
    run = services.start_run(
        agent_name="support", message="slow", owner_id="jane", created_by=alice,
        params=script_params(LOOKUP, dict(UPDATE_CRM, hang=60), SAY_DONE), enqueue=False,
    )
    def work() -> None:
        try:
            executor.execute(run.run_id)
        finally:
            connection.close()  # this thread's own connection, or dropping the test database fails

    worker = threading.Thread(target=work)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while not run.tool_calls.filter(tool_name="update_crm").exists():
            assert time.monotonic() < deadline, "the hanging tool never started"
            time.sleep(0.05)

        asked = time.monotonic()
        requested = services.cancel_run(run.run_id, actor=alice)
        assert requested.status == RunStatus.RUNNING
        assert requested.cancel_requested_at is not None
        worker.join(timeout=30)
        took = time.monotonic() - asked
    finally:
        worker.join(timeout=60)
    assert not worker.is_alive()

    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    # A few heartbeats (0.2 s each here), with room for a busy shared machine.
    assert took < settings.RUN_HEARTBEAT_SECONDS * 25, f"cancellation took {took:.1f} s"
    assert run.tools_executed == ["lookup_customer", "update_crm"]
    journal = {c.tool_name: c.status for c in run.tool_calls.all()}
    assert journal == {"lookup_customer": ToolCallStatus.ANSWERED, "update_crm": ToolCallStatus.FAILED}
    # ADK's abort seals the pending call instead of leaving it dangling in the session.
    responses = [
        r for e in AdkEvent.objects.filter(session_id=run.session_id) for r in e.function_responses
    ]
    assert {r["name"] for r in responses} == {"lookup_customer", "update_crm"}
    # The tool was stopped before its effect.
    assert CrmNote.objects.count() == 0
    # A cancelled run obeys the replay rules like any failure. The CRM note's effect record was
    # written before the tool started and the cancel stopped the tool inside: whether it acted is
    # unknown, so the call is in doubt until a person settles it (the read-only lookup never blocks).
    decision = rules.decide(run, force=False)
    assert decision.code == "calls_in_doubt"
    assert decision.refusal.context["tools"] == ["update_crm"]
    assert decision.refusal.detail == (
        "This run's call to update_crm is in doubt: it was started and never finished, so it is unknown "
        "whether it acted, and a replay could do it again. Settle it (done or not done) once you know. "
        "Pass force=true to run it again anyway."
    )


def test_cancelling_twice_is_harmless_and_a_settled_run_is_refused(alice):
    run = services.start_run(agent_name="support", message="hi", owner_id="jane", created_by=alice, enqueue=False)
    assert lifecycle.claim_run(run_id=run.run_id, worker="w1")
    first = services.cancel_run(run.run_id, actor=alice)
    second = services.cancel_run(run.run_id, actor=alice)
    assert first.cancel_requested_at == second.cancel_requested_at

    lifecycle.settle_run(run_id=run.run_id, status=RunStatus.CANCELLED)
    with pytest.raises(RunAlreadySettled) as caught:
        services.cancel_run(run.run_id, actor=alice)
    assert caught.value.status == 409
    assert caught.value.code == "run_settled"


def test_another_users_run_cannot_be_cancelled(alice, bob):
    run = services.start_run(agent_name="support", message="hi", owner_id="jane", created_by=alice, enqueue=False)
    with pytest.raises(RunNotFound):
        services.cancel_run(run.run_id, actor=bob)
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.QUEUED
