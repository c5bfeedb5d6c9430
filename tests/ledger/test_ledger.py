"""The run ledger: a run is written down before it starts, and settles with what it called."""

from __future__ import annotations

import hashlib
import io
import threading

import pytest
from django.core import mail
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection
from google.adk.agents import LlmAgent

from agents import registry
from agents.models import AdkEvent, OutboxEmail
from runs.ledger import journal, lifecycle
from runs.models.ledger import AgentRun, RunStatus, ToolCall, ToolCallStatus
from runs.services import run as services
from tests.helpers import (
    LOOKUP,
    SAY_DONE,
    SEND_EMAIL,
    UPDATE_CRM,
    run_now,
    script_params,
)

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed


def _read_committed_run(run_id: str) -> dict:
    """Read the run on a brand-new connection, which only sees committed rows."""
    found: dict = {}

    def read() -> None:
        try:
            row = AgentRun.objects.filter(pk=run_id).values().first()
            found["row"] = row
        finally:
            connection.close()

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    return found["row"]


@pytest.fixture
def probe_agent(monkeypatch):
    """An agent whose only tool inspects the ledger from inside the tool."""
    seen: list[dict] = []

    async def probe_ledger(tool_context) -> dict:
        """Inspect the ledger."""
        from asgiref.sync import sync_to_async

        run_id = tool_context.custom_metadata["run_id"]
        row = await sync_to_async(_read_committed_run, thread_sensitive=False)(run_id)
        stored = None
        if row and row["input_file"]:
            with open(row["input_file"], "rb") as handle:
                stored = hashlib.sha256(handle.read()).hexdigest()
        seen.append({"row": row, "stored_sha256": stored})
        return {"ok": True}

    spec = registry.describe(
        "probe",
        LlmAgent(name="probe", description="test probe", instruction="probe", tools=[probe_ledger]),
        default_script=[{"call": "probe_ledger", "args": {}}, SAY_DONE],
    )
    monkeypatch.setitem(registry.AGENTS, "probe", spec)
    return seen


@committed
def test_run_row_and_file_are_committed_before_the_first_tool_runs(probe_agent):
    content = b"invoice 42: 19.99 EUR\n"
    run = run_now(agent_name="probe", message="check the ledger", file=io.BytesIO(content), file_name="invoice.txt")

    assert run.status == RunStatus.SUCCESS
    assert len(probe_agent) == 1
    row = probe_agent[0]["row"]
    assert row is not None, "the run row was not committed when the tool started"
    assert row["status"] == RunStatus.RUNNING
    assert row["config"] == {"message": "check the ledger", "params": {}}
    assert row["input_file_name"] == "invoice.txt"
    assert row["input_file_sha256"] == hashlib.sha256(content).hexdigest()
    assert probe_agent[0]["stored_sha256"] == hashlib.sha256(content).hexdigest()
    assert row["input_file_size"] == len(content)


@committed
def test_successful_run_lists_its_tools_in_order():
    run = run_now(params=script_params(LOOKUP, SEND_EMAIL, UPDATE_CRM, SAY_DONE))

    assert run.status == RunStatus.SUCCESS
    assert run.tools_executed == ["lookup_customer", "send_email", "update_crm"]
    assert run.result == "Done."
    assert run.attempts == 1
    assert run.started_at and run.finished_at and run.worker
    journal = list(run.tool_calls.order_by("seq"))
    assert [c.tool_name for c in journal] == ["lookup_customer", "send_email", "update_crm"]
    assert [c.seq for c in journal] == [1, 2, 3]
    assert all(c.status == ToolCallStatus.ANSWERED for c in journal)
    assert journal[1].args == SEND_EMAIL["args"]
    assert OutboxEmail.objects.filter(run_id=run.run_id).count() == 1
    assert len(mail.outbox) == 1


@committed
def test_failure_before_any_call_records_an_empty_list():
    run = run_now(params=script_params({"fail": "error", "message": "backend down"}))

    assert run.status == RunStatus.ERROR
    assert run.tools_executed == []
    assert run.error_code == "model_error"
    assert "backend down" in run.error_message


@committed
def test_failure_after_calls_lists_them_in_order():
    run = run_now(params=script_params(LOOKUP, SEND_EMAIL, {"fail": "error", "message": "lost"}))

    assert run.status == RunStatus.ERROR
    assert run.tools_executed == ["lookup_customer", "send_email"]


@committed
def test_tool_that_fails_after_its_effect_counts_as_called():
    step = dict(UPDATE_CRM, tool_fails="CRM is down")
    run = run_now(params=script_params(step))

    assert run.status == RunStatus.ERROR
    assert run.error_code == "tool_failed"
    assert "CRM is down" in run.error_message
    assert run.tools_executed == ["update_crm"]
    call = run.tool_calls.get()
    assert call.status == ToolCallStatus.FAILED


@committed
def test_parallel_calls_are_journaled_as_separate_rows():
    run = run_now(params=script_params([LOOKUP, SEND_EMAIL], SAY_DONE))

    assert run.tools_executed == ["lookup_customer", "send_email"]
    assert run.tool_calls.count() == 2


@committed
def test_empty_turn_is_an_error_a_person_understands(settings):
    settings.EMPTY_TURN_RETRIES = 0  # retried empty turns are covered in test_retries.py
    run = run_now(params=script_params({"empty": True}))

    assert run.status == RunStatus.ERROR
    assert run.error_code == "empty_turn"
    assert "empty answer" in run.error_message
    assert run.tools_executed == []


@committed
def test_tools_executed_falls_back_to_the_session_when_the_journal_cannot_be_read(monkeypatch):
    def unreadable(run_id):
        raise DatabaseError("journal table unavailable")

    monkeypatch.setattr(journal, "journal_tools", unreadable)
    run = run_now(params=script_params(SEND_EMAIL, {"fail": "error", "message": "lost"}))

    assert run.tools_executed == ["send_email"]


@committed
def test_tools_executed_is_null_when_neither_journal_nor_session_can_be_read(monkeypatch):
    def unreadable(*args, **kwargs):
        raise DatabaseError("unavailable")

    monkeypatch.setattr(journal, "journal_tools", unreadable)
    # The settle reads the journal inside its UPDATE.
    monkeypatch.setattr(journal, "has_journal", unreadable)
    monkeypatch.setattr(journal, "session_tools", unreadable)
    run = run_now(params=script_params(SEND_EMAIL, {"fail": "error", "message": "lost"}))

    assert run.status == RunStatus.ERROR
    assert run.tools_executed is None
    assert run.tools_state == "unknown"


@committed
def test_session_fallback_only_counts_calls_after_the_runs_own_user_message():
    first = run_now(params=script_params(SEND_EMAIL, SAY_DONE))
    second = run_now(
        params=script_params({"fail": "error", "message": "no tools this time"}),
        session_id=first.session_id,
    )

    assert journal.session_tools(first) == ["send_email"]
    assert journal.session_tools(second) == []
    assert second.tools_executed == []


@committed
def test_the_run_lives_in_its_own_adk_session_tied_to_the_run():
    run = run_now(params=script_params(SEND_EMAIL, SAY_DONE))

    events = list(AdkEvent.objects.filter(session_id=run.session_id).order_by("timestamp"))
    assert events[0].author == "user"
    assert events[0].parts[0]["text"] == run.message
    assert {e.invocation_id for e in events} == {run.invocation_id}
    assert all(e.data.get("custom_metadata", {}).get("run_id") == str(run.run_id) for e in events)
    assert [c["name"] for e in events for c in e.function_calls] == ["send_email"]


@committed
def test_a_second_delivery_of_the_task_does_nothing():
    from runs.execution.executor import execute as execute_run

    run = run_now(params=script_params(SEND_EMAIL, SAY_DONE))
    assert execute_run(str(run.run_id)) == "not claimed"

    run.refresh_from_db()
    assert run.attempts == 1
    assert OutboxEmail.objects.count() == 1
    assert ToolCall.objects.filter(run=run).count() == 1


def test_a_late_outcome_never_overwrites_a_settled_run():
    run = services.start_run(agent_name="support", message="hi", owner_id="alice", enqueue=False)
    assert lifecycle.claim_run(run_id=run.run_id, worker="w1")
    AgentRun.objects.filter(pk=run.run_id).update(status=RunStatus.ERROR, error_code="reconciled")

    assert lifecycle.settle_run(run_id=run.run_id, status=RunStatus.SUCCESS, result="late") is False
    run.refresh_from_db()
    assert run.status == RunStatus.ERROR
    assert run.error_code == "reconciled"
    assert run.late_outcome["status"] == RunStatus.SUCCESS
    assert run.late_outcome["result"] == "late"


def test_start_run_announces_the_run_to_the_workers(announced):
    run = services.start_run(agent_name="support", message="hi", owner_id="alice")

    assert announced == [run.run_id]
    assert AgentRun.objects.get(pk=run.run_id).status == RunStatus.QUEUED


def test_a_started_run_is_claimable_from_the_ledger_and_nothing_lands_in_the_broker():
    from django_q.models import OrmQ

    run = services.start_run(agent_name="support", message="hi", owner_id="alice")
    assert not OrmQ.objects.exists()
    assert list(lifecycle.claimable_runs().values_list("run_id", flat=True)) == [run.run_id]


@committed
def test_heartbeat_advances_while_a_tool_hangs():
    run = services.start_run(
        agent_name="support",
        message="slow",
        owner_id="alice",
        params=script_params(dict(LOOKUP, hang=1.0), SAY_DONE),
        enqueue=False,
    )
    beats: list = []
    finished = threading.Event()

    def watch() -> None:
        # Watched for as long as the run takes, not a fixed window: on a loaded machine the run
        # may reach its tool seconds after it was started.
        try:
            while not finished.wait(0.1):
                value = AgentRun.objects.filter(pk=run.run_id).values_list("heartbeat_at", flat=True).first()
                if value:
                    beats.append(value)
        finally:
            connection.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    from runs.execution import executor

    try:
        executor.execute(run.run_id)
    finally:
        finished.set()
        watcher.join()
    assert len(set(beats)) >= 3, "the heartbeat did not advance while the tool was busy"


# --- Bad input: a clear error and no row ---------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        ({"agent_name": "nope"}, "agent", "no agent named 'nope'"),
        ({"message": "   "}, "message", "empty"),
        ({"message": ""}, "message", "empty"),
        ({"owner_id": ""}, "owner_id", "required"),
        ({"owner_id": "x" * 200}, "owner_id", "longer than"),
        ({"params": ["not", "a", "dict"]}, "params", "JSON object"),
        ({"params": {"script": "call send_email"}}, "params", "must be a list"),
        ({"params": {"script": [{"call": "drop_database"}]}}, "params", "no tool named 'drop_database'"),
        ({"params": {"script": [{"fail": "sometimes"}]}}, "params", "rate_limit"),
        ({"params": {"script": [{"call": "send_email", "crash": "maybe"}]}}, "params", "before_effect"),
        ({"params": {"script": []}}, "params", "empty"),
    ],
)
def test_bad_input_is_refused_with_a_message_and_no_row(kwargs, field, words):
    arguments = {"agent_name": "support", "message": "hi", "owner_id": "alice", **kwargs}
    with pytest.raises(ValidationError) as caught:
        services.start_run(enqueue=False, **arguments)

    assert words in " ".join(caught.value.message_dict[field])
    assert AgentRun.objects.count() == 0


def test_faults_are_refused_when_disabled(settings):
    settings.SCRIPTED_FAULTS_ENABLED = False
    with pytest.raises(ValidationError) as caught:
        services.start_run(
            agent_name="support",
            message="hi",
            owner_id="alice",
            params=script_params(dict(SEND_EMAIL, crash="after_effect")),
            enqueue=False,
        )
    assert "SCRIPTED_FAULTS_ENABLED" in caught.value.message_dict["params"][0]


def test_file_over_the_limit_is_refused_and_nothing_is_kept(settings):
    settings.MAX_UPLOAD_BYTES = 1000
    with pytest.raises(ValidationError) as caught:
        services.start_run(
            agent_name="support",
            message="hi",
            owner_id="alice",
            file=io.BytesIO(b"x" * 1001),
            file_name="big.bin",
            enqueue=False,
        )
    assert "MAX_UPLOAD_BYTES" in caught.value.message_dict["file"][0]
    assert AgentRun.objects.count() == 0
    assert not any(settings.RUN_INPUTS_DIR.glob("*/*")) if settings.RUN_INPUTS_DIR.exists() else True


@pytest.mark.parametrize("name", ["../etc/passwd", "..", "a/b.txt", "..\\x.txt", ".hidden", "ok\x00.txt", ""])
def test_file_names_that_could_escape_are_refused(name, settings):
    with pytest.raises(ValidationError) as caught:
        services.start_run(
            agent_name="support",
            message="hi",
            owner_id="alice",
            file=io.BytesIO(b"data"),
            file_name=name,
            enqueue=False,
        )
    assert caught.value.message_dict["file"]
    assert AgentRun.objects.count() == 0
    assert not settings.RUN_INPUTS_DIR.exists() or not any(settings.RUN_INPUTS_DIR.iterdir())


def test_several_problems_are_reported_together():
    with pytest.raises(ValidationError) as caught:
        services.start_run(agent_name="nope", message="", owner_id="", enqueue=False)
    assert set(caught.value.message_dict) == {"agent", "message", "owner_id"}


@committed
def test_the_copied_file_survives_deletion_of_the_original(tmp_path, settings):
    original = tmp_path / "report.pdf"
    original.write_bytes(b"%PDF-1.4 original content")
    with original.open("rb") as handle:
        run = services.start_run(
            agent_name="support", message="read it", owner_id="alice", file=handle, file_name="report.pdf", enqueue=False
        )
    original.unlink()

    from pathlib import Path

    stored = Path(run.input_file)
    assert stored.read_bytes() == b"%PDF-1.4 original content"
    assert stored.parent.parent == settings.RUN_INPUTS_DIR
    assert run.input_file_sha256 == hashlib.sha256(b"%PDF-1.4 original content").hexdigest()
    from runs.execution import executor

    executor.execute(run.run_id)
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCESS
    user_event = AdkEvent.objects.filter(session_id=run.session_id, invocation_id=run.invocation_id).order_by("timestamp").first()
    assert user_event.parts[1]["inline_data"]["display_name"] == "report.pdf"
