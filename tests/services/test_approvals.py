"""Approvals and tools that wait, durable (docs/architecture.md, "Approvals and tools that wait").

A run that asks for a confirmation, or leaves a long-running call unanswered, leaves its worker as
`waiting`; a decision (or a result) continues the same run. In-process tests here; the crash and
concurrency cases, with real processes, are at the end and need PostgreSQL.
"""

from __future__ import annotations

import json
import signal
import textwrap
import threading
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.utils import timezone

from agents.models import Refund
from agents.services import save_workflow
from runs.execution import executor
from runs.execution.executor import execute as execute_run
from runs.ledger import lifecycle, reconcile
from runs.models.approvals import Decision, PendingCall, WaitKind
from runs.models.effects import ToolEffect
from runs.models.ledger import AgentRun, RunStatus
from runs.refusals import AlreadyDecided, ApproveNotPermitted, RunWaiting
from runs.rules import overview, resume
from runs.rules import replay as rules
from runs.services import decisions
from runs.services import run as services
from runs.worker import processes as worker
from tests.chat.test_chat import _turn, alice_token, server  # noqa: F401 - the live server's fixtures
from tests.helpers import LOOKUP, postgres_only, run_now, run_python, script_params
from tests.kit import api, login

db = pytest.mark.django_db(transaction=True)  # runs cross the Django/ADK seam: real commits

BIG_REFUND = {"call": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 25_000}}
SMALL_REFUND = {"call": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 2_500}}
RETURN_LABEL = {"call": "request_return_label", "args": {"order_id": "A-1001"}}
REFUNDED = {"say": "Refunded order A-1001."}


@pytest.fixture
def approver(django_user_model):
    """Support staff who may approve or reject calls that wait (runs.approve_toolcall) for every owner
    (runs.act_for_any_owner): deciding asks the owner rule as a result does."""
    user = django_user_model.objects.create_user("ada", password="ada-pass-123", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(
        codename__in=["view_agentrun", "approve_toolcall", "act_for_any_owner"]))
    return user


@pytest.fixture
def warehouse(django_user_model):
    """An external system's account: gives long-running calls their results for any owner."""
    user = django_user_model.objects.create_user("warehouse", password="warehouse-pass-123")
    user.user_permissions.add(*Permission.objects.filter(
        codename__in=["view_agentrun", "answer_toolcall", "act_for_any_owner"]))
    return user


def execute(run: AgentRun) -> AgentRun:
    executor.execute(run.run_id)
    run.refresh_from_db()
    return run


def waiting_refund(alice, *steps) -> tuple[AgentRun, PendingCall]:
    run = run_now(params=script_params(BIG_REFUND, *(steps or (REFUNDED,))), created_by=alice)
    assert run.status == RunStatus.WAITING, (run.error_code, run.error_message)
    (pending,) = PendingCall.objects.filter(run=run)
    return run, pending


@db
def test_a_big_refund_waits_without_acting_and_an_approval_continues_the_same_run(alice, approver):
    run, pending = waiting_refund(alice)
    # Bound to the exact call as asked; nothing was refunded, no slot or heartbeat held.
    assert (pending.kind, pending.tool_name, pending.args) == (WaitKind.CONFIRMATION, "issue_refund", BIG_REFUND["args"])
    assert pending.request_call_id and pending.decision == ""
    assert Refund.objects.count() == 0 and ToolEffect.objects.count() == 0
    # Asked, not run: the journal and the run say so, on every door.
    assert run.heartbeat_at is None and run.finished_at is None and run.tools_executed == []
    (asked,) = run.tool_calls.all()
    assert asked.status == "waiting"
    call = api(approver).get(f"/api/runs/{run.run_id}/").json()["tool_calls"][0]
    assert (call["status"], call["state"]) == ("waiting", "waiting")

    answer = api(approver).post(f"/api/runs/{run.run_id}/calls/{pending.call_id}/decision/",
                                {"decision": "approve", "note": "Order checked."}, format="json")
    assert answer.status_code == 202, answer.json()
    assert (answer.json()["decision"], answer.json()["decided_by"], answer.json()["run_status"]) == (
        "approve", "ada", "queued")

    run = execute(run)
    assert run.status == RunStatus.SUCCESS, (run.error_code, run.error_message)
    assert (run.attempts, run.result) == (2, "Refunded order A-1001.")
    (refund,) = Refund.objects.all()
    assert (refund.order_id, refund.amount_cents, refund.run_id, refund.call_id) == (
        "A-1001", 25_000, run.run_id, pending.call_id)
    # The approved call obeyed every rule: journaled, its effect record done under the run's intent.
    (call,) = run.tool_calls.all()
    assert (call.call_id, call.status, call.effect) == (pending.call_id, "answered", "idempotent")
    assert run.tools_executed == ["issue_refund"]
    assert ToolEffect.objects.get(key=call.effect_key).status == "done"
    pending.refresh_from_db()
    assert (pending.decision, pending.decided_by, pending.note, pending.delivered_attempt) == (
        Decision.APPROVE, approver, "Order checked.", 2)


@db
def test_a_small_refund_needs_no_approval(alice):
    run = run_now(params=script_params(SMALL_REFUND, {"say": "Refunded."}), created_by=alice)
    assert run.status == RunStatus.SUCCESS and Refund.objects.count() == 1
    assert not PendingCall.objects.exists()


@db
def test_a_rejection_tells_the_model_and_nothing_is_refunded(alice, approver, requests_seen, admin_user):
    run, pending = waiting_refund(alice, {"say": "The refund was not approved."})
    decisions.decide_call(run_id=run.run_id, call_id=pending.call_id, actor=approver, decision="reject",
                          note="Not owed.")
    requests_seen.clear()
    run = execute(run)
    assert (run.status, run.result) == (RunStatus.SUCCESS, "The refund was not approved.")
    assert Refund.objects.count() == 0
    # The effect record the gate's pass would have started is gone: a later approval could still refund once.
    assert ToolEffect.objects.count() == 0
    responses = [part.function_response.response for content in requests_seen[-1].contents
                 for part in content.parts if part.function_response and part.function_response.id == pending.call_id]
    assert responses[-1] == {"error": "This tool call is rejected."}
    # Rejected and not run: never in tools_executed, never `answered`, on the API and the run page.
    assert run.tools_executed == []
    (call,) = run.tool_calls.all()
    assert (call.status, call.response_summary) == ("not_run", "rejected by ada: not run")
    data = api(approver).get(f"/api/runs/{run.run_id}/").json()
    assert data["tools_executed"] == [] and (data["tool_calls"][0]["status"], data["tool_calls"][0]["state"]) == (
        "not_run", "rejected")
    page = login(admin_user)
    html = page.get(f"/admin/runs/agentrun/{run.run_id}/change/").content.decode()
    assert "rejected, not run" in html and "answered" not in html.split('id="tool_calls-group"')[1].split("</fieldset>")[0]


@db
def test_a_decision_is_taken_once(alice, approver):
    run, pending = waiting_refund(alice)
    decisions.decide_call(run_id=run.run_id, call_id=pending.call_id, actor=approver, decision="approve")
    with pytest.raises(AlreadyDecided):
        decisions.decide_call(run_id=run.run_id, call_id=pending.call_id, actor=approver, decision="reject")
    second = api(approver).post(f"/api/runs/{run.run_id}/calls/{pending.call_id}/decision/",
                                {"decision": "approve"}, format="json")
    assert second.status_code == 409 and second.json()["code"] == "already_decided"
    pending.refresh_from_db()
    assert pending.decision == Decision.APPROVE


@db
def test_deciding_needs_the_permission_and_bad_input_is_refused(alice, support_agent, approver):
    run, pending = waiting_refund(alice)
    url = f"/api/runs/{run.run_id}/calls/{pending.call_id}/decision/"
    refused = api(support_agent).post(url, {"decision": "approve"}, format="json")
    assert refused.status_code == 403 and refused.json()["code"] == "approve_not_permitted"
    with pytest.raises(ApproveNotPermitted):
        decisions.decide_call(run_id=run.run_id, call_id=pending.call_id, actor=alice, decision="approve")
    assert api(approver).post(url, {"decision": "maybe"}, format="json").status_code == 400
    assert api(approver).post(url, {"decision": "approve", "extra": 1}, format="json").status_code == 400
    missing = api(approver).post(f"/api/runs/{run.run_id}/calls/nope/decision/", {"decision": "approve"},
                                 format="json")
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    wrong_kind = api(approver).post(f"/api/runs/{run.run_id}/calls/{pending.call_id}/result/", {"result": {}},
                                    format="json")
    assert wrong_kind.status_code == 403  # the approver may not give results
    run.refresh_from_db()
    pending.refresh_from_db()
    assert run.status == RunStatus.WAITING and pending.decision == ""


@db
def test_a_long_running_call_waits_for_its_result_then_the_model_gets_it(alice, warehouse, bob, requests_seen):
    run = run_now(params=script_params(RETURN_LABEL, {"say": "Here is your return label."}), created_by=alice)
    assert run.status == RunStatus.WAITING, (run.error_code, run.error_message)
    (pending,) = PendingCall.objects.filter(run=run)
    assert (pending.kind, pending.tool_name, pending.args) == (WaitKind.RESULT, "request_return_label",
                                                                RETURN_LABEL["args"])
    url = f"/api/runs/{run.run_id}/calls/{pending.call_id}/result/"
    assert api(bob).post(url, {"result": {"label": "x"}}, format="json").status_code == 404  # bob cannot see it
    wrong = api(warehouse).post(f"/api/runs/{run.run_id}/calls/{pending.call_id}/decision/",
                                {"decision": "approve"}, format="json")
    assert wrong.status_code == 403
    answer = api(warehouse).post(url, {"result": {"label_url": "https://carrier.example/l/1"}}, format="json")
    assert answer.status_code == 202, answer.json()
    requests_seen.clear()
    run = execute(run)
    assert (run.status, run.attempts, run.result) == (RunStatus.SUCCESS, 2, "Here is your return label.")
    seen = [part.function_response.response for content in requests_seen[-1].contents for part in content.parts
            if part.function_response and part.function_response.id == pending.call_id]
    assert seen == [{"label_url": "https://carrier.example/l/1"}]
    (call,) = run.tool_calls.all()
    assert call.status == "answered"


@db
def test_an_unanswered_request_times_out_as_a_rejection_with_its_reason(alice, settings):
    run, pending = waiting_refund(alice, {"say": "The refund request timed out."})
    assert decisions.expire_waiting() == 0  # not due yet
    later = timezone.now() + timedelta(seconds=settings.APPROVAL_TIMEOUT_SECONDS + 1)
    assert decisions.expire_waiting(now=later) == 1
    assert decisions.expire_waiting(now=later) == 0  # idempotent
    pending.refresh_from_db()
    assert (pending.decision, pending.by_system, pending.decided_by) == (Decision.REJECT, True, None)
    assert "APPROVAL_TIMEOUT_SECONDS=259200" in pending.note
    run = execute(run)
    assert (run.status, run.result) == (RunStatus.SUCCESS, "The refund request timed out.")
    assert Refund.objects.count() == 0


@db
def test_a_waiting_run_is_neither_replayed_nor_resumed(alice, support_lead):
    run, _pending = waiting_refund(alice)
    decision = rules.decide(run, force=True)
    assert isinstance(decision.refusal, RunWaiting) and decision.refusal.code == "run_waiting"
    for path in ("replay", "resume"):
        answer = api(support_lead).post(f"/api/runs/{run.run_id}/{path}/",
                                        {"force": True, "reason": "try"} if path == "replay" else {}, format="json")
        assert answer.status_code == 409 and answer.json()["code"] == "run_waiting", answer.json()
    assert resume.decide_resume(run).code == "run_waiting"
    assert AgentRun.objects.count() == 1


@db
def test_cancelling_a_waiting_run_settles_it_and_closes_its_calls(alice, approver):
    run, pending = waiting_refund(alice)
    answer = api(alice).post(f"/api/runs/{run.run_id}/cancel/", {}, format="json")
    assert answer.status_code == 202 and answer.json()["status"] == "cancelled"
    run.refresh_from_db()
    # The call it waited for never ran: none called, its journal row closed as not run.
    assert (run.status, run.tools_executed) == (RunStatus.CANCELLED, [])
    assert run.tool_calls.get().status == "not_run"
    pending.refresh_from_db()
    assert pending.decision == Decision.CANCELLED
    late = api(approver).post(f"/api/runs/{run.run_id}/calls/{pending.call_id}/decision/", {"decision": "approve"},
                              format="json")
    assert late.status_code == 409
    assert Refund.objects.count() == 0


@db
def test_a_run_waits_for_every_call_it_asked_about_before_it_goes_on(alice, approver):
    other = {"call": "issue_refund", "args": {"order_id": "A-2002", "amount_cents": 40_000}}
    run = run_now(params=script_params([BIG_REFUND, other], {"say": "Both handled."}), created_by=alice)
    assert run.status == RunStatus.WAITING
    first, second = PendingCall.objects.filter(run=run).order_by("pk")
    decisions.decide_call(run_id=run.run_id, call_id=first.call_id, actor=approver, decision="approve")
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING
    decisions.decide_call(run_id=run.run_id, call_id=second.call_id, actor=approver, decision="reject")
    run = execute(AgentRun.objects.get(pk=run.pk))
    assert run.status == RunStatus.SUCCESS, run.error_message
    assert list(Refund.objects.values_list("order_id", flat=True)) == ["A-1001"]


@db
def test_the_run_page_api_lists_what_the_run_waits_for(alice, approver):
    run, pending = waiting_refund(alice, LOOKUP, REFUNDED)
    body = api(approver).get(f"/api/runs/{run.run_id}/").json()
    assert body["status"] == "waiting"
    (listed,) = body["pending_calls"]
    assert (listed["call_id"], listed["tool_name"], listed["decision"], listed["consumed"]) == (
        pending.call_id, "issue_refund", "", False)
    assert body["replay_decision"]["code"] == "run_waiting"
    assert api(approver).get("/api/runs/?status=waiting").json()["results"][0]["run_id"] == str(run.run_id)


# --- The desk, the run page, metrics -----------------------------------------------------------------


@db
def test_the_desk_counts_approvals_waiting_and_names_the_oldest(alice, admin_user):
    assert overview.build_overview().approvals_waiting.count.value == 0
    first, pending = waiting_refund(alice)
    waiting_refund(alice)
    data = overview.build_overview()
    assert (data.approvals_waiting.count.value, data.approvals_waiting.oldest.call_id) == (2, pending.call_id)
    assert data.in_flight.count.value == 0  # waiting is not in flight: it holds no worker
    client = login(admin_user)
    page = client.get("/admin/desk/").content.decode()
    assert 'id="approvals-waiting"' in page and "Approvals waiting" in page and str(first.run_id)[:8] in page
    listed = client.get("/admin/runs/agentrun/?desk=waiting").content.decode()
    assert str(first.run_id) in listed


@db
def test_metrics_count_the_calls_that_wait(alice, settings):
    settings.METRICS_ENABLED, settings.METRICS_TOKEN = True, "t0ken"
    waiting_refund(alice)
    run_now(params=script_params(RETURN_LABEL, REFUNDED), created_by=alice)
    body = Client(headers={"Authorization": "Bearer t0ken"}).get("/metrics").content.decode()
    assert 'agentledger_calls_waiting{kind="confirmation"} 1.0' in body
    assert 'agentledger_calls_waiting{kind="result"} 1.0' in body
    assert "agentledger_call_waiting_age_max_seconds" in body


@db
def test_the_run_page_shows_the_call_and_a_person_approves_it_there(alice, approver, support_agent):
    run, pending = waiting_refund(alice)
    page_url = f"/admin/runs/agentrun/{run.run_id}/change/"
    answer_url = f"/admin/runs/agentrun/{run.run_id}/calls/{pending.call_id}/answer/"
    staff = login(support_agent)
    page = staff.get(page_url).content.decode()
    assert f'id="waiting-{pending.call_id}"' in page and "permission to approve" in page
    assert 'id="run-live"' in page and "Waiting for 1 call" in page
    staff.post(answer_url, {"decision": "approve", "note": "sure"})  # refused: no permission
    pending.refresh_from_db()
    assert pending.decision == ""

    person = login(approver)
    assert 'name="decision" value="approve"' in person.get(page_url).content.decode()
    response = person.post(answer_url, {"decision": "approve", "note": "Order checked."}, follow=True)
    assert "approved. The run goes on." in response.content.decode()
    pending.refresh_from_db()
    assert (pending.decision, pending.decided_by, pending.note) == (Decision.APPROVE, approver, "Order checked.")
    again = person.post(answer_url, {"decision": "reject"}, follow=True).content.decode()
    assert "already answered" in again
    run = execute(run)
    assert run.status == RunStatus.SUCCESS and Refund.objects.count() == 1
    assert "Decisions taken" in person.get(page_url).content.decode()


@db
def test_the_schema_states_the_two_doors(client, admin_user):
    client.force_login(admin_user)
    schema = client.get("/api/schema/", {"format": "json"}).json()
    decision = schema["paths"]["/api/runs/{run_id}/calls/{call_id}/decision/"]["post"]
    result = schema["paths"]["/api/runs/{run_id}/calls/{call_id}/result/"]["post"]
    assert set(decision["responses"]) >= {"202", "400", "403", "404", "409"}
    assert set(result["responses"]) >= {"202", "400", "403", "404", "409"}
    request = schema["components"]["schemas"]["DecisionRequest"]
    assert request["required"] == ["decision"] and request["additionalProperties"] is False
    assert schema["components"]["schemas"]["PersonDecisionEnum"]["enum"] == ["approve", "reject"]
    assert "waiting" in schema["components"]["schemas"]["RunStatusEnum"]["enum"]
    assert "pending_calls" in schema["components"]["schemas"]["RunDetail"]["properties"]


# --- Restarts, kills and races (real processes) -------------------------------------------------------


@db
def test_a_decision_survives_the_worker_that_should_have_taken_it(alice, approver):
    # The decision commits and enqueues; the worker that would take it dies before claiming. The
    # run stays queued (the sweep leaves a run whose task waits in the broker alone), the task is
    # delivered again, and the run goes on once.
    run, pending = waiting_refund(alice)
    decisions.decide_call(run_id=run.run_id, call_id=pending.call_id, actor=approver, decision="approve")
    reconcile.sweep(now=timezone.now() + timedelta(hours=1))
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    assert execute_run(str(run.run_id)) == RunStatus.SUCCESS
    assert execute_run(str(run.run_id)) == "not claimed"
    assert Refund.objects.count() == 1


@db
def test_a_run_that_died_before_its_answers_reached_adk_is_resumed_from_the_decision(alice, approver, admin_user):
    # The attempt that took the approval was claimed and died before handing ADK the answers (as
    # after a SIGKILL; tests/processes/test_approvals_crash.py kills it for real): the decision is the evidence.
    run, pending = waiting_refund(alice)
    decisions.decide_call(run_id=run.run_id, call_id=pending.call_id, actor=approver, decision="approve")
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.ERROR, error_code=reconcile.RECONCILED, attempts=2,
                                              finished_at=timezone.now())
    run.refresh_from_db()
    decision = resume.decide_resume(run)
    assert decision.allowed, decision.as_dict()
    (answer,) = decision.answers
    assert (answer.call_id, answer.kind, answer.response["confirmed"]) == (
        pending.request_call_id, resume.FROM_DECISION, True)
    continued = services.resume_run(run.run_id, actor=admin_user)
    continued = execute(continued)
    assert (continued.status, continued.result) == (RunStatus.SUCCESS, REFUNDED["say"]), continued.error_message
    (refund,) = Refund.objects.all()
    assert refund.call_id == pending.call_id


@db
def test_a_waiting_run_is_never_reconciled_nor_claimed(alice):
    run, _pending = waiting_refund(alice)
    reconcile.sweep(now=timezone.now() + timedelta(days=30))
    run.refresh_from_db()
    assert (run.status, run.attempts) == (RunStatus.WAITING, 1)
    assert execute_run(str(run.run_id)) == "not claimed"
    assert lifecycle.claim_queued_runs(worker="w1", limit=10) == []


def _child_runs_and_dies(script: list) -> str:
    """A worker process that runs a support run until it waits, then dies by SIGKILL."""
    code = textwrap.dedent(f"""
        import os, signal
        from runs.execution import executor
        from runs.services import run as services
        run = services.start_run(agent_name="support", message="Jane was charged twice.", owner_id="alice",
                                 params={{"script": {json.dumps(script)}}}, enqueue=False)
        executor.execute(run.run_id)
        print(run.run_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    child = run_python(code)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    return child.stdout.split()[0]


@pytest.mark.slow
@postgres_only
@db
def test_a_worker_killed_while_its_run_waits_leaves_it_waiting_and_an_approval_continues_it_once(approver):
    run_id = _child_runs_and_dies([BIG_REFUND, REFUNDED])
    run = AgentRun.objects.get(pk=run_id)
    assert run.status == RunStatus.WAITING
    reconcile.sweep(now=timezone.now() + timedelta(hours=1))  # a later sweep, as after a restart
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING and Refund.objects.count() == 0
    (pending,) = run.pending_calls.all()
    decisions.decide_call(run_id=run_id, call_id=pending.call_id, actor=approver, decision="approve", note="ok")
    # Another worker process takes it.
    worker = run_python(f"from runs.execution.executor import execute as execute_run\nprint(execute_run({run_id!r}))")
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert worker.stdout.split()[-1] == RunStatus.SUCCESS
    run.refresh_from_db()
    assert (run.status, run.attempts, run.result) == (RunStatus.SUCCESS, 2, REFUNDED["say"])
    assert Refund.objects.count() == 1


@pytest.mark.slow
@postgres_only
@db
def test_two_concurrent_decisions_on_one_call_take_one(alice, approver):
    run, pending = waiting_refund(alice)
    code = textwrap.dedent("""
        from django.contrib.auth import get_user_model
        from config.lib.refusals import Refusal
        from runs.services import decisions
        actor = get_user_model().objects.get(pk={actor})
        try:
            print(decisions.decide_call(run_id="{run}", call_id="{call}", actor=actor, decision="{decision}").decision)
        except Refusal as refusal:
            print(refusal.code)
    """)
    results: list[str] = []

    def child(decision: str) -> None:
        finished = run_python(code.format(actor=approver.pk, run=run.run_id, call=pending.call_id, decision=decision),
                              timeout=300)
        assert finished.returncode == 0, finished.stderr[-2000:]
        results.append(finished.stdout.split()[-1])

    threads = [threading.Thread(target=child, args=(decision,)) for decision in ("approve", "reject")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results).count("already_decided") == 1, results
    pending.refresh_from_db()
    assert pending.decision in results
    run = execute(AgentRun.objects.get(pk=run.pk))
    assert run.status == RunStatus.SUCCESS
    assert Refund.objects.count() == (1 if pending.decision == Decision.APPROVE else 0)


@pytest.mark.slow
@postgres_only
@db
def test_a_worker_killed_inside_the_approved_tool_leaves_it_in_doubt_never_done_twice(alice, approver):
    run, pending = waiting_refund(alice, REFUNDED)
    AgentRun.objects.filter(pk=run.pk).update(config={**run.config, "params": script_params(
        dict(BIG_REFUND, crash="after_effect"), REFUNDED)})
    decisions.decide_call(run_id=run.run_id, call_id=pending.call_id, actor=approver, decision="approve")
    worker = run_python(f"from runs.execution.executor import execute as execute_run\nexecute_run({str(run.run_id)!r})")
    assert worker.returncode == -signal.SIGKILL, worker.stderr[-3000:]
    assert Refund.objects.count() == 1  # it acted, then died
    reconcile.sweep(now=timezone.now() + timedelta(hours=1))
    run.refresh_from_db()
    assert (run.status, run.error_code, run.attempts) == (RunStatus.ERROR, "reconciled", 2)
    call = run.tool_calls.get(call_id=pending.call_id)
    assert call.in_doubt  # journal first: the approved call was `called` again before its tool ran
    assert rules.decide(run, force=False).refusal.code == "calls_in_doubt"
    assert execute_run(str(run.run_id)) == "not claimed"
    assert Refund.objects.count() == 1


@db
def test_a_gated_calls_scripted_fault_befalls_the_attempt_that_runs_it_not_the_one_that_asks(alice, approver, settings):
    settings.SCRIPTED_FAULTS_ENABLED = True
    alice.user_permissions.add(Permission.objects.get(codename="place_tool_faults"))
    run = run_now(params=script_params(dict(BIG_REFUND, tool_fails="the bank hung up"), REFUNDED), created_by=alice)
    # The tool only asked for its confirmation: nothing befell it, and nothing was refunded.
    assert run.status == RunStatus.WAITING, (run.error_code, run.error_message)
    assert Refund.objects.count() == 0
    (pending,) = PendingCall.objects.filter(run=run)
    decisions.decide_call(run_id=run.run_id, call_id=pending.call_id, actor=approver, decision="approve")
    run = execute(run)
    # The approved call ran, acted, then failed as scripted.
    assert (run.status, run.error_code) == (RunStatus.ERROR, "tool_failed"), run.error_message
    assert "the bank hung up" in run.error_message
    assert Refund.objects.count() == 1


@db
def test_a_chat_turn_queued_again_after_it_waited_is_a_workers_not_abandoned(alice, approver):
    run, pending = waiting_refund(alice)
    AgentRun.objects.filter(pk=run.pk).update(trigger="chat")
    decisions.decide_call(run_id=run.run_id, call_id=pending.call_id, actor=approver, decision="approve")
    later = timezone.now() + timedelta(hours=1)
    # Its server's client is gone, but the turn was claimed before: nothing to abandon.
    assert reconcile.abandon_lost_chat_turns(now=later) == 0
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    # A worker claims it from the ledger like any run, and takes it on.
    assert worker.run_queued() == [RunStatus.SUCCESS]
    run.refresh_from_db()
    assert (run.status, run.attempts) == (RunStatus.SUCCESS, 2)


# --- Chat ----------------------------------------------------------------------------------------------


@db
def test_a_chat_turn_that_waits_says_so_and_keeps_its_conversation_busy(server, alice_token, approver):  # noqa: F811
    response, frames = _turn(server, alice_token, message="Refund order A-1001, please.",
                             params=script_params(BIG_REFUND, {"say": "Refunded order A-1001."}))
    assert response.status_code == 200
    kinds = [kind for kind, _ in frames]
    assert kinds[-2:] == ["waiting", "done"]
    waiting, done = frames[-2][1], frames[-1][1]
    assert done["status"] == "waiting" and done["waiting_for"] == waiting["waiting_for"]
    (call,) = waiting["waiting_for"]
    assert (call["tool_name"], call["kind"], call["args"]) == ("issue_refund", "confirmation", BIG_REFUND["args"])

    busy, _ = _turn(server, alice_token, message="And?", conversation_id=done["conversation_id"],
                    params=script_params({"say": "Hm."}))
    assert busy.status_code == 409 and busy.json()["code"] == "conversation_busy"

    decisions.decide_call(run_id=done["run_id"], call_id=call["call_id"], actor=approver, decision="approve")
    assert execute_run(done["run_id"]) == RunStatus.SUCCESS  # a worker takes the turn on
    turn = AgentRun.objects.get(pk=done["run_id"])
    assert (turn.result, turn.attempts) == ("Refunded order A-1001.", 2)
    after, frames = _turn(server, alice_token, message="Thanks!", conversation_id=done["conversation_id"],
                          params=script_params({"say": "You're welcome."}))
    assert after.status_code == 200 and frames[-1][1]["status"] == "success"
    assert Refund.objects.count() == 1


# --- Workflows ---------------------------------------------------------------------------------------


@db
def test_a_workflow_step_that_asks_for_approval_stops_the_run_and_says_why(alice):
    # Workflow runs cannot wait yet (docs/runs.md, "Approvals and tools that wait"): refused loudly, never a success without the answer.
    save_workflow(name="refunds", graph={"steps": {"support": {"agent": "support"}, "triage": {"agent": "triage"}},
                                         "chains": [["START", "support", "triage"]]})
    run = run_now(agent_name="refunds", message="Refund order A-1001.", created_by=alice, params={"scripts": {
        "support": [BIG_REFUND, REFUNDED], "triage": [{"say": "Filed."}]}})
    assert (run.status, run.error_code) == (RunStatus.ERROR, "workflow_cannot_wait"), run.error_message
    assert "issue_refund" in run.error_message and "cannot wait" in run.error_message
    assert Refund.objects.count() == 0 and not PendingCall.objects.exists()
    assert not ToolEffect.objects.filter(status="started").exists()
    assert "triage" not in {step.step_name for step in run.steps.all()}  # no step ran on the unanswered output
