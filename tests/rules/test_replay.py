"""The replay rules and the replay service: one decision for every door."""

from __future__ import annotations

import io
import threading
import uuid
from pathlib import Path

import pytest
from django.contrib.admin.models import LogEntry
from django.db import connection

from agents.models import AdkEvent, OutboxEmail
from runs.ledger import chain
from runs.models.ledger import AgentRun, RunStatus
from runs.refusals import (
    AlreadyReplayed,
    ForceNotPermitted,
    InputGone,
    ReasonRequired,
    ReplayInFlight,
    RunInFlight,
    RunNotFound,
    RunSucceeded,
    ToolsCalled,
    ToolsUnknown,
)
from runs.rules import replay as rules
from runs.services import run as services
from tests.factories import TOOLS_CALLED_API, TOOLS_UNKNOWN_API, make_run
from tests.helpers import SAY_DONE, SEND_EMAIL, UPDATE_CRM, postgres_only, run_now, script_params

# --- decide(): pure, every row, in order ------------------------------------------------------------


def unsaved(status=RunStatus.ERROR, tools=None, input_file=""):
    return AgentRun(
        run_id=uuid.uuid4(),
        agent_name="support",
        owner_id="jane",
        config={"message": "hi", "params": {}},
        status=status,
        tools_executed=tools,
        input_file=input_file,
        input_file_name="invoice.txt" if input_file else "",
    )


NO_FACTS = rules.ReplayFacts()


def replay_summary(status):
    return chain.Successor(uuid.uuid4(), status)


@pytest.mark.parametrize(
    "status, tools, facts, force, expected",
    [
        (RunStatus.QUEUED, [], NO_FACTS, False, RunInFlight),
        (RunStatus.RUNNING, [], NO_FACTS, True, RunInFlight),
        (RunStatus.SUCCESS, ["send_email"], NO_FACTS, False, RunSucceeded),
        (RunStatus.SUCCESS, ["send_email"], NO_FACTS, True, None),
        (RunStatus.ERROR, [], NO_FACTS, False, None),
        (RunStatus.CANCELLED, [], NO_FACTS, False, None),
        (RunStatus.ERROR, [], NO_FACTS, True, None),
        (RunStatus.ERROR, ["send_email"], NO_FACTS, False, ToolsCalled),
        (RunStatus.CANCELLED, ["send_email"], NO_FACTS, False, ToolsCalled),
        (RunStatus.ERROR, ["send_email"], NO_FACTS, True, None),
        (RunStatus.ERROR, None, NO_FACTS, False, ToolsUnknown),
        (RunStatus.CANCELLED, None, NO_FACTS, False, ToolsUnknown),
        (RunStatus.ERROR, None, NO_FACTS, True, None),
        (RunStatus.ERROR, [], rules.ReplayFacts(replays=(replay_summary(RunStatus.QUEUED),)), False, ReplayInFlight),
        (RunStatus.ERROR, [], rules.ReplayFacts(replays=(replay_summary(RunStatus.RUNNING),)), True, ReplayInFlight),
        (RunStatus.ERROR, [], rules.ReplayFacts(replays=(replay_summary(RunStatus.SUCCESS),)), False, AlreadyReplayed),
        (RunStatus.ERROR, [], rules.ReplayFacts(replays=(replay_summary(RunStatus.SUCCESS),)), True, None),
        # A replay that failed does not block another one.
        (RunStatus.ERROR, [], rules.ReplayFacts(replays=(replay_summary(RunStatus.ERROR),)), False, None),
        (RunStatus.ERROR, [], rules.ReplayFacts(input_present=False), False, InputGone),
        (RunStatus.ERROR, [], rules.ReplayFacts(input_present=False), True, InputGone),
    ],
)
def test_every_row_of_the_table(status, tools, facts, force, expected):
    run = unsaved(status, tools, input_file="/stored/invoice.txt")
    decision = rules.decide(run, force=force, facts=facts)

    if expected is None:
        assert decision.allowed and decision.status == 202 and decision.code == "replayable"
    else:
        assert isinstance(decision.refusal, expected)
        assert decision.status == expected.status
        assert decision.code == expected.code


@pytest.mark.parametrize(
    "status, tools, facts, expected",
    [
        # in flight beats everything, including a replay in flight and a missing file
        (
            RunStatus.RUNNING,
            None,
            rules.ReplayFacts(replays=(replay_summary(RunStatus.QUEUED),), input_present=False),
            "run_in_flight",
        ),
        # a replay in flight is said before the missing file
        (RunStatus.ERROR, None, rules.ReplayFacts(replays=(replay_summary(RunStatus.QUEUED),), input_present=False), "replay_in_flight"),
        # the missing file is said before anything force could fix
        (RunStatus.SUCCESS, None, rules.ReplayFacts(replays=(replay_summary(RunStatus.SUCCESS),), input_present=False), "input_gone"),
        (RunStatus.SUCCESS, ["send_email"], rules.ReplayFacts(replays=(replay_summary(RunStatus.SUCCESS),)), "run_succeeded"),
        (RunStatus.ERROR, ["send_email"], rules.ReplayFacts(replays=(replay_summary(RunStatus.SUCCESS),)), "already_replayed"),
        (RunStatus.ERROR, None, rules.ReplayFacts(replays=(replay_summary(RunStatus.SUCCESS),)), "already_replayed"),
    ],
)
def test_rows_are_checked_in_the_documented_order(status, tools, facts, expected):
    run = unsaved(status, tools, input_file="/stored/invoice.txt")
    assert rules.decide(run, force=False, facts=facts).code == expected


def test_the_two_messages_from_the_design_word_for_word():
    unknown = rules.decide(unsaved(tools=None), force=False, facts=NO_FACTS).refusal
    called = rules.decide(
        unsaved(tools=["send_email", "update_crm", "send_email", "update_crm"]), force=False, facts=NO_FACTS
    ).refusal

    assert unknown.detail == TOOLS_UNKNOWN_API
    assert called.detail == TOOLS_CALLED_API
    assert called.context["tools"] == ["send_email", "update_crm"]
    assert unknown.admin_detail == TOOLS_UNKNOWN_API.replace(
        "Pass force=true to run it again anyway.", "Use “Force replay…” to run it again anyway."
    )
    assert called.admin_detail.endswith("a replay would call them again. Use “Force replay…” to run it again anyway.")


def test_tools_are_listed_once_in_first_call_order():
    run = unsaved(tools=["update_crm", "lookup_customer", "update_crm", "send_email", "lookup_customer"])
    refusal = rules.decide(run, force=False, facts=NO_FACTS).refusal
    assert refusal.context["tools"] == ["update_crm", "lookup_customer", "send_email"]
    assert "already called update_crm, lookup_customer, send_email before failing" in refusal.detail


def test_refusals_that_name_a_replay_carry_its_id():
    blocker = replay_summary(RunStatus.RUNNING)
    refusal = rules.decide(unsaved(tools=[]), force=True, facts=rules.ReplayFacts(replays=(blocker,))).refusal
    assert refusal.context["replay_run_id"] == str(blocker.run_id)
    assert str(blocker.run_id) in refusal.detail


def test_force_reports_what_it_overrides():
    decision = rules.decide(unsaved(tools=["send_email"]), force=True, facts=NO_FACTS)
    assert decision.allowed
    assert decision.overridden.code == "tools_called"


def test_decide_is_pure_given_facts():
    # No django_db mark: any query here would fail the test, and the file is never looked at.
    run = unsaved(tools=["send_email"], input_file="/does/not/exist")
    assert rules.decide(run, force=False, facts=NO_FACTS).code == "tools_called"
    assert rules.decide(run, force=True, facts=NO_FACTS).allowed


# --- replay_run: the service -------------------------------------------------------------------------

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
pytestmark_db = pytest.mark.django_db(transaction=True)


@pytestmark_db
def test_a_failed_run_with_no_tools_is_replayed_as_a_new_run_in_a_new_session(alice, tmp_path):
    original = run_now(
        params=script_params({"fail": "error", "message": "backend down"}),
        created_by=alice,
        file=io.BytesIO(b"invoice 42"),
        file_name="invoice.txt",
        trigger="webhook",
    )
    assert original.status == RunStatus.ERROR and original.tools_executed == []
    before = AgentRun.objects.filter(pk=original.pk).values().get()
    original_events = list(AdkEvent.objects.filter(session_id=original.session_id).values_list("id", flat=True))

    replay = services.replay_run(original.run_id, actor=alice, force=False, reason="")

    assert replay.run_id != original.run_id
    assert replay.replay_of_id == original.run_id
    assert replay.status == RunStatus.QUEUED
    assert replay.session_id != original.session_id
    assert replay.config == original.config
    assert replay.trigger == "webhook"
    assert replay.owner_id == original.owner_id
    assert replay.created_by == alice
    assert (replay.input_file, replay.input_file_sha256, replay.input_file_size, replay.input_file_name) == (
        original.input_file,
        original.input_file_sha256,
        original.input_file_size,
        "invoice.txt",
    )
    assert replay.forced is False and replay.forced_by is None and replay.force_reason == ""
    assert AgentRun.objects.filter(pk=original.pk).values().get() == before

    # The replay executes in its own session and never writes into the original's.
    from runs.execution import executor

    AgentRun.objects.filter(pk=replay.pk).update(config={**replay.config, "params": script_params(SAY_DONE)})
    executor.execute(replay.run_id)
    replay.refresh_from_db()
    assert replay.status == RunStatus.SUCCESS
    assert list(AdkEvent.objects.filter(session_id=original.session_id).values_list("id", flat=True)) == original_events
    replay_events = AdkEvent.objects.filter(session_id=replay.session_id).order_by("timestamp")
    assert replay_events.first().parts[1]["inline_data"]["display_name"] == "invoice.txt"
    assert {e.invocation_id for e in replay_events} == {replay.invocation_id}
    assert AgentRun.objects.filter(pk=original.pk).values().get() == before


@pytestmark_db
def test_the_replay_is_enqueued_on_commit(announced, alice, django_capture_on_commit_callbacks):
    original = make_run(tools=[], created_by=alice)
    replay = services.replay_run(original.run_id, actor=alice)
    assert announced == [replay.run_id]


@pytestmark_db
def test_a_refused_replay_writes_nothing(alice):
    original = make_run(tools=["send_email", "update_crm"], created_by=alice)
    with pytest.raises(ToolsCalled) as caught:
        services.replay_run(original.run_id, actor=alice)
    assert caught.value.detail == TOOLS_CALLED_API
    assert AgentRun.objects.count() == 1
    assert LogEntry.objects.count() == 0


@pytestmark_db
def test_force_needs_the_permission_and_a_reason(alice, support_agent, support_lead):
    original = make_run(tools=["send_email"])
    with pytest.raises(ForceNotPermitted):
        services.replay_run(original.run_id, actor=support_agent, force=True, reason="customer asked")
    with pytest.raises(ReasonRequired):
        services.replay_run(original.run_id, actor=support_lead, force=True, reason="   ")
    assert AgentRun.objects.count() == 1


@pytestmark_db
def test_a_forced_replay_is_recorded_on_the_run_and_in_the_admin_log(support_lead):
    original = make_run(tools=["send_email", "update_crm"])
    replay = services.replay_run(original.run_id, actor=support_lead, force=True, reason="  Email bounced, resend  ")

    assert replay.forced is True
    assert replay.forced_by == support_lead
    assert replay.force_reason == "Email bounced, resend"
    entries = {entry.object_id: entry for entry in LogEntry.objects.all()}
    assert set(entries) == {str(original.run_id), str(replay.run_id)}
    assert entries[str(replay.run_id)].is_addition()
    assert entries[str(replay.run_id)].user == support_lead
    assert "Email bounced, resend" in entries[str(replay.run_id)].change_message
    assert "tools_called" in entries[str(original.run_id)].change_message


@pytestmark_db
def test_forcing_a_replayable_run_is_an_ordinary_replay(support_lead):
    original = make_run(tools=[])
    replay = services.replay_run(original.run_id, actor=support_lead, force=True, reason="why not")
    assert replay.forced is False
    assert LogEntry.objects.count() == 0


@pytestmark_db
def test_a_second_replay_waits_for_the_first_and_then_for_success(support_lead):
    original = make_run(tools=[])
    first = services.replay_run(original.run_id, actor=support_lead)
    with pytest.raises(ReplayInFlight) as caught:
        services.replay_run(original.run_id, actor=support_lead, force=True, reason="again")
    assert caught.value.context["replay_run_id"] == str(first.run_id)

    AgentRun.objects.filter(pk=first.pk).update(status=RunStatus.SUCCESS, tools_executed=[])
    with pytest.raises(AlreadyReplayed):
        services.replay_run(original.run_id, actor=support_lead)
    second = services.replay_run(original.run_id, actor=support_lead, force=True, reason="the customer asked twice")
    assert second.forced and second.replay_of_id == original.run_id


@pytestmark_db
@pytest.mark.parametrize("damage", ["delete", "truncate", "rewrite"])
def test_a_replay_never_runs_on_an_input_that_changed(support_lead, damage):
    original = make_run(tools=[], file=b"invoice 42: 19.99 EUR")
    stored = Path(original.input_file)
    if damage == "delete":
        stored.unlink()
    elif damage == "truncate":
        stored.write_bytes(b"invoice")
    else:
        stored.write_bytes(b"invoice 42: 99.99 EUR")  # same size, other bytes
    with pytest.raises(InputGone) as caught:
        services.replay_run(original.run_id, actor=support_lead, force=True, reason="please")
    assert caught.value.status == 410
    assert AgentRun.objects.count() == 1


@pytestmark_db
def test_another_users_run_is_not_found(alice, bob):
    original = make_run(tools=[], created_by=alice)
    with pytest.raises(RunNotFound):
        services.replay_run(original.run_id, actor=bob)
    with pytest.raises(RunNotFound):
        services.replay_run(uuid.uuid4(), actor=alice)
    with pytest.raises(RunNotFound):
        services.replay_run("not-a-uuid", actor=alice)


@pytestmark_db
def test_a_replay_of_a_real_failure_repeats_its_calls_only_when_forced_to_redo_them(support_lead):
    original = run_now(params=script_params(SEND_EMAIL, UPDATE_CRM, {"fail": "error", "message": "lost"}))
    assert original.tools_executed == ["send_email", "update_crm"]
    with pytest.raises(ToolsCalled):
        services.replay_run(original.run_id, actor=support_lead)
    assert OutboxEmail.objects.count() == 1
    from runs.execution import executor

    # Forced, reusing the recorded effects (the default): the email is served from its record.
    reused = services.replay_run(original.run_id, actor=support_lead, force=True, reason="the run failed late")
    executor.execute(reused.run_id)
    reused.refresh_from_db()
    assert reused.status == RunStatus.ERROR  # the same script, the same failure
    assert reused.effects == "reuse"
    assert OutboxEmail.objects.count() == 1

    # Forced, redoing the effects: the email is sent again, because that is what was asked.
    replay = services.replay_run(
        original.run_id, actor=support_lead, force=True, reason="the email bounced", effects="redo"
    )
    executor.execute(replay.run_id)
    replay.refresh_from_db()
    assert replay.status == RunStatus.ERROR
    assert replay.effects == "redo"
    assert OutboxEmail.objects.count() == 2
    assert OutboxEmail.objects.filter(run_id=replay.run_id).count() == 1


# --- Concurrency -------------------------------------------------------------------------------------


@postgres_only
@pytestmark_db
def test_fifty_simultaneous_replay_requests_create_exactly_one_replay(support_lead):
    original = make_run(tools=[])
    requests = 50
    barrier = threading.Barrier(requests)
    outcomes: list[object] = []
    lock = threading.Lock()

    def request_replay() -> None:
        try:
            connection.ensure_connection()  # a real connection of its own, opened before the race
            barrier.wait(timeout=60)
            try:
                result: object = services.replay_run(original.run_id, actor=support_lead)
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                result = exc
            with lock:
                outcomes.append(result)
        finally:
            connection.close()

    threads = [threading.Thread(target=request_replay) for _ in range(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert len(outcomes) == requests
    replays = [o for o in outcomes if isinstance(o, AgentRun)]
    refusals = [o for o in outcomes if not isinstance(o, AgentRun)]
    assert len(replays) == 1, refusals[:3]
    assert all(isinstance(r, ReplayInFlight) for r in refusals), {type(r).__name__ for r in refusals}
    assert all(r.context["replay_run_id"] == str(replays[0].run_id) for r in refusals)
    assert AgentRun.objects.filter(replay_of=original).count() == 1
