"""Crashes and restarts with real processes: no amnesia, no déjà vu."""

from __future__ import annotations

import json
import signal

import pytest

from agents.models import AdkEvent, OutboxEmail
from runs.execution.executor import execute as execute_run
from runs.models.ledger import AgentRun, RunStatus, ToolCallStatus
from tests.helpers import EMAIL_ARGS, LOOKUP, SAY_DONE, SEND_EMAIL, run_manage, run_now, run_python, script_params

# Killed and restarted processes read what the test committed, and the test reads theirs.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _start_in_child(script: list, *, expect_signal: int | None = None) -> AgentRun:
    child = run_manage(
        "run_agent", "support", "Email Jane about her refund", "--owner", "alice", "--inline",
        "--script", json.dumps(script),
    )
    if expect_signal is not None:
        assert child.returncode == -expect_signal, child.stderr[-2000:]
    else:
        assert child.returncode == 0, child.stderr[-2000:]
    run_id = child.stdout.splitlines()[0].strip()
    return AgentRun.objects.get(pk=run_id)


@pytest.mark.parametrize("crash_point", ["before_effect", "after_effect"])
def test_worker_killed_inside_a_tool_leaves_evidence_and_never_reruns(crash_point):
    run = _start_in_child([LOOKUP, dict(SEND_EMAIL, crash=crash_point), SAY_DONE], expect_signal=signal.SIGKILL)

    # The process died inside send_email: no settle, the run still says running.
    assert run.status == RunStatus.RUNNING
    assert run.attempts == 1

    # The ADK session with the function call survived in the database.
    events = AdkEvent.objects.filter(session_id=run.session_id).order_by("timestamp")
    calls = [c["name"] for e in events for c in e.function_calls]
    answered = [r["name"] for e in events for r in e.function_responses]
    assert calls == ["lookup_customer", "send_email"]
    assert answered == ["lookup_customer"]

    # The journal holds the call as in doubt.
    journal = {c.tool_name: c.status for c in run.tool_calls.all()}
    assert journal == {"lookup_customer": ToolCallStatus.ANSWERED, "send_email": ToolCallStatus.CALLED}

    expected_emails = 1 if crash_point == "after_effect" else 0
    assert OutboxEmail.objects.filter(run_id=run.run_id).count() == expected_emails

    # django-q2 delivers the task again after its lease: it must not execute the run again.
    assert execute_run(str(run.run_id)) == "not claimed"
    run.refresh_from_db()
    assert run.attempts == 1
    assert run.status == RunStatus.RUNNING
    assert OutboxEmail.objects.filter(run_id=run.run_id).count() == expected_emails
    assert run.tool_calls.count() == 2


def test_the_session_survives_a_restart_of_the_process():
    run = run_now(params=script_params(LOOKUP, SEND_EMAIL, SAY_DONE))

    code = f"""
import asyncio
from agents.adk import run_coroutine, session_service

async def read():
    session = await session_service().get_session(app_name="support", user_id="alice", session_id="{run.session_id}")
    return [(e.author, [p.function_call.name for p in (e.content.parts if e.content else []) if p.function_call]) for e in session.events]

print(repr(run_coroutine(read())))
"""
    child = run_python(code)
    assert child.returncode == 0, child.stderr[-2000:]
    events = eval(child.stdout.strip().splitlines()[-1])  # noqa: S307 - our own repr
    assert events[0][0] == "user"
    assert [name for _, names in events for name in names] == ["lookup_customer", "send_email"]
    assert len(events) == 6  # user, 2 × (call, response), final answer


def test_a_run_started_here_and_executed_by_another_process_sees_its_input(tmp_path):
    from runs.services import run as services

    source = tmp_path / "note.txt"
    source.write_text("Please refund order 42.")
    with source.open("rb") as handle:
        run = services.start_run(
            agent_name="support",
            message="Handle the attached note.",
            owner_id="alice",
            file=handle,
            file_name="note.txt",
            params=script_params(dict(SEND_EMAIL, args=EMAIL_ARGS), SAY_DONE),
            enqueue=False,
        )
    source.unlink()

    child = run_python(f"from runs.execution.executor import execute as execute_run; print(execute_run('{run.run_id}'))")
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().splitlines()[-1] == RunStatus.SUCCESS
    run.refresh_from_db()
    assert run.tools_executed == ["send_email"]
    first = AdkEvent.objects.filter(session_id=run.session_id).order_by("timestamp").first()
    assert first.parts[1]["inline_data"]["display_name"] == "note.txt"
