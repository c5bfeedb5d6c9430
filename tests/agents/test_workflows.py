"""Workflows on ADK's Workflow primitives: definitions, runs with recorded steps, failures, cancels."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from agents import scripted, workflows
from agents.models import AdkEvent, CrmNote, OutboxEmail, WorkflowDefinition
from agents.registry import get_agent_spec
from agents.services import check_workflow, save_workflow
from runs.execution import executor
from runs.ledger import outcomes
from runs.management.commands.seed_demo import DEMO_WORKFLOW
from runs.models.ledger import AgentRun, RunStatus, RunStep, StepStatus, ToolCallStatus, Trigger
from runs.rules import replay as rules
from runs.services import run as services
from runs.services.decisions import settle_call
from tests.helpers import LOOKUP, SAY_DONE, SEND_EMAIL, UPDATE_CRM, run_now, wait_until

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed


def say(text: str) -> dict:
    return {"say": text}


def define(name: str, chains: list, **steps) -> WorkflowDefinition:
    return save_workflow(name=name, graph={"steps": steps, "chains": chains})


def steps_of(run: AgentRun) -> list[RunStep]:
    return list(run.steps.order_by("seq"))


@pytest.fixture
def demo():
    return save_workflow(**DEMO_WORKFLOW)


@pytest.fixture
def observed():
    """Every request the scripted model receives, with the agent that sent it."""
    seen: list = []
    scripted.request_observers.append(seen.append)
    yield seen
    scripted.request_observers.remove(seen.append)


def request_text(request) -> str:
    return "\n".join(part.text or "" for content in request.contents for part in content.parts or [])


def run_in_thread(run_id):
    def work() -> None:
        try:
            executor.execute(run_id)
        finally:
            connection.close()  # this thread's own connection, or dropping the test database fails

    worker = threading.Thread(target=work)
    worker.start()
    return worker



# --- Runs: chain, fan-out and join ------------------------------------------------------------------


@committed
def test_a_chain_runs_its_steps_in_order_and_hands_each_output_to_the_next(alice, observed):
    define(
        "intake",
        [["START", "request", "triage", "support"]],
        request={"function": "request_text"},
        triage={"agent": "triage"},
        support={"agent": "support"},
    )
    run = run_now(
        agent_name="intake", message="  Jane asks about her refund.  ", created_by=alice,
        params={"scripts": {"triage": [say("Refund question, normal priority.")], "support": [LOOKUP, say("Answered.")]}},
    )

    assert run.status == RunStatus.SUCCESS, run.error_message
    assert run.trigger == Trigger.WORKFLOW
    assert run.config["workflow"]["name"] == "intake"
    steps = steps_of(run)
    assert [(s.seq, s.step_name, s.kind, s.target, s.status) for s in steps] == [
        (1, "request", "function", "request_text", StepStatus.SUCCESS),
        (2, "triage", "agent", "triage", StepStatus.SUCCESS),
        (3, "support", "agent", "support", StepStatus.SUCCESS),
    ]
    assert [s.node_path for s in steps] == ["intake@1/request@1", "intake@1/triage@1", "intake@1/support@1"]
    assert [s.output_summary for s in steps] == ["Jane asks about her refund.", "Refund question, normal priority.", "Answered."]
    assert all(s.finished_at >= s.started_at for s in steps)
    assert steps[0].finished_at <= steps[1].started_at <= steps[1].finished_at <= steps[2].started_at
    # Each agent was asked with the output of the step before it.
    triage_request, support_request = observed[0], observed[1]
    assert request_text(triage_request).endswith("Jane asks about her refund.")
    assert "Refund question, normal priority." in request_text(support_request)
    assert run.result == "Answered."
    assert run.tools_executed == ["lookup_customer"]


@committed
def test_fan_out_and_join_record_every_step_and_the_last_agent_gets_both_findings(alice, demo, observed):
    run = run_now(agent_name="refund_review", created_by=alice)

    assert run.status == RunStatus.SUCCESS, run.error_message
    steps = steps_of(run)
    # The two branches start together (in either order), then the join, the brief, the answer.
    assert {s.step_name for s in steps[:2]} == {"triage", "billing"}
    assert [s.step_name for s in steps[2:]] == ["findings", "brief", "support"]
    assert all(s.status == StepStatus.SUCCESS for s in steps)
    by_name = {s.step_name: s for s in steps}
    triage_text, billing_text = get_agent_spec("triage").default_script[-1]["say"], get_agent_spec("billing").default_script[-1]["say"]
    assert by_name["triage"].output_summary == triage_text
    assert by_name["billing"].output_summary == billing_text
    assert json.loads(by_name["findings"].output_summary) == {"billing": billing_text, "triage": triage_text}
    brief = f"billing: {billing_text}\n\ntriage: {triage_text}"
    assert by_name["brief"].output_summary == brief
    # The join waited for both branches.
    assert by_name["findings"].started_at >= max(by_name["triage"].finished_at, by_name["billing"].finished_at)
    # The final agent was given what both branches found.
    support_requests = [r for r in observed if "send_email" in str(r.tools_dict)]
    assert brief in request_text(support_requests[0])
    assert run.result == get_agent_spec("support").default_script[-1]["say"]
    # Every step's tool calls are the run's: both branches' lookups and support's actions.
    assert sorted(run.tools_executed) == sorted(
        ["lookup_customer", "lookup_customer", "lookup_customer", "send_email", "update_crm"]
    )
    assert run.tool_calls.count() == 5
    assert OutboxEmail.objects.filter(run_id=run.run_id).count() == 1


@committed
def test_a_workflow_runs_a_sub_workflow_as_a_step(alice):
    define("checks", [["START", "triage", "brief"]], triage={"agent": "triage"}, brief={"function": "request_text"})
    define(
        "outer",
        [["START", ["checks", "billing"], "findings", "support"]],
        checks={"workflow": "checks"},
        billing={"agent": "billing"},
        findings={"join": True},
        support={"agent": "support"},
    )
    run = run_now(
        agent_name="outer", created_by=alice,
        params={"scripts": {"triage": [say("T")], "billing": [say("B")], "support": [say("S")]}},
    )
    assert run.status == RunStatus.SUCCESS, run.error_message
    paths = {s.node_path: s for s in steps_of(run)}
    assert set(paths) == {
        "outer@1/checks@1", "outer@1/checks@1/triage@1", "outer@1/checks@1/brief@1",
        "outer@1/billing@1", "outer@1/findings@1", "outer@1/support@1",
    }
    assert paths["outer@1/checks@1"].kind == "workflow"
    assert paths["outer@1/checks@1"].output_summary == "T"
    assert json.loads(paths["outer@1/findings@1"].output_summary) == {"billing": "B", "checks": "T"}
    assert run.result == "S"


@committed
def test_the_run_keeps_the_graph_it_was_started_with(alice):
    definition = define("short", [["START", "triage"]], triage={"agent": "triage"})
    run = services.start_run(agent_name="short", message="hi", owner_id="jane", created_by=alice, enqueue=False)
    definition.graph = {"steps": {"billing": {"agent": "billing"}}, "chains": [["START", "billing"]]}
    definition.save()
    executor.execute(run.run_id)
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCESS
    assert [s.step_name for s in steps_of(run)] == ["triage"]


# --- Failures ----------------------------------------------------------------------------------------


@committed
def test_a_failing_branch_cancels_its_sibling_and_the_run_lists_the_tools_of_every_branch(alice):
    define(
        "risky",
        [["START", ["support", "billing"], "findings", "brief"]],
        support={"agent": "support"},
        billing={"agent": "billing"},
        findings={"join": True},
        brief={"function": "combine_findings"},
    )
    run = run_now(
        agent_name="risky", created_by=alice,
        params={"scripts": {
            # The email goes out; then the CRM fails (after writing its note) while billing still waits.
            "support": [dict(SEND_EMAIL, hang=0.5), dict(UPDATE_CRM, tool_fails="The CRM is down."), SAY_DONE],
            "billing": [dict(LOOKUP, hang=60), dict(LOOKUP, args={"email": "omar@example.com"}), say("B")],
        }},
    )

    assert run.status == RunStatus.ERROR
    assert run.error_code == "tool_failed"
    assert "Step “support” (risky@1/support@1) failed" in run.error_message
    assert "The CRM is down." in run.error_message
    assert sorted(run.tools_executed) == ["lookup_customer", "send_email", "update_crm"]
    steps = {s.step_name: s for s in steps_of(run)}
    assert set(steps) == {"support", "billing"}
    assert steps["support"].status == StepStatus.ERROR
    assert "The CRM is down." in steps["support"].error
    assert steps["billing"].status == StepStatus.CANCELLED
    assert steps["billing"].finished_at is not None
    # The sibling was stopped inside its tool: its second lookup never ran.
    journal = {(c.tool_name, c.args.get("email")): c.status for c in run.tool_calls.all()}
    assert journal[("update_crm", None)] == ToolCallStatus.FAILED
    assert ("lookup_customer", "omar@example.com") not in journal
    assert CrmNote.objects.filter(run_id=run.run_id).count() == 1

    # update_crm raised after writing its note: its effect record never finished, so it is in doubt.
    decision = rules.decide(run, force=False)
    assert decision.code == "calls_in_doubt"
    assert decision.refusal.context["tools"] == ["update_crm"]
    # Settled (the note is there), the run is one that called tools that act; the lookups never block.
    call = run.tool_calls.get(tool_name="update_crm")
    settle_call(run_id=run.run_id, call_id=call.call_id, actor=get_user_model().objects.create_superuser("desk"),
                outcome="done", note="The CRM shows the note.")
    decision = rules.decide(run, force=False)
    assert decision.code == "tools_called"
    assert set(decision.refusal.context["tools"]) == {"send_email", "update_crm"}
    assert decision.refusal.detail.startswith("This run already called ")


@committed
def test_a_step_that_failed_before_any_tool_is_retried_and_one_that_called_a_tool_is_not(alice):
    define(
        "retrying",
        [["START", "support"]],
        support={"agent": "support", "retry": {"max_attempts": 3, "initial_delay": 0.01}},
    )
    flaky = run_now(
        agent_name="retrying", created_by=alice,
        params={"scripts": {"support": [{"fail": "error", "message": "The model hiccupped."}, LOOKUP, SAY_DONE]}},
    )
    assert flaky.status == RunStatus.SUCCESS, flaky.error_message
    (step,) = steps_of(flaky)
    assert (step.status, step.attempts) == (StepStatus.SUCCESS, 2)

    acted = run_now(
        agent_name="retrying", created_by=alice,
        params={"scripts": {"support": [SEND_EMAIL, {"fail": "error", "message": "The model hiccupped."}, SAY_DONE]}},
    )
    assert acted.status == RunStatus.ERROR
    assert acted.error_code == "model_error"
    assert "The model hiccupped." in acted.error_message
    (step,) = steps_of(acted)
    assert (step.status, step.attempts) == (StepStatus.ERROR, 1)
    assert acted.tools_executed == ["send_email"]
    assert OutboxEmail.objects.filter(run_id=acted.run_id).count() == 1


@committed
def test_a_workflow_run_that_failed_before_any_tool_replays_the_graph_it_stored(alice, support_lead):
    definition = define("fragile", [["START", "triage"]], triage={"agent": "triage"})
    run = run_now(
        agent_name="fragile", created_by=alice,
        params={"scripts": {"triage": [{"fail": "error", "message": "down"}]}},
    )
    assert (run.status, run.tools_executed) == (RunStatus.ERROR, [])
    definition.delete()

    replay = services.replay_run(run.run_id, actor=support_lead)
    assert replay.trigger == Trigger.WORKFLOW
    assert replay.config == run.config
    executor.execute(replay.run_id)
    replay.refresh_from_db()
    # The script still fails, but the stored graph ran although the definition is gone.
    assert replay.status == RunStatus.ERROR
    assert [s.step_name for s in steps_of(replay)] == ["triage"]


# --- Cancellation ------------------------------------------------------------------------------------


@committed
def test_cancelling_mid_workflow_stops_every_step_and_sub_workflow_within_a_few_heartbeats(settings, alice):
    define("inner", [["START", "triage"]], triage={"agent": "triage"})
    define(
        "long",
        [["START", ["inner", "billing"], "findings", "support"]],
        inner={"workflow": "inner"},
        billing={"agent": "billing"},
        findings={"join": True},
        support={"agent": "support"},
    )
    run = services.start_run(
        agent_name="long", message="slow", owner_id="jane", created_by=alice, enqueue=False,
        params={"scripts": {
            "triage": [dict(LOOKUP, hang=60), say("T")],
            "billing": [dict(LOOKUP, hang=60), say("B")],
        }},
    )
    worker = run_in_thread(run.run_id)
    try:
        wait_until(lambda: run.tool_calls.count() == 2, step=0.05, what="both hanging lookups")
        asked = time.monotonic()
        services.cancel_run(run.run_id, actor=alice)
        worker.join(timeout=30)
        took = time.monotonic() - asked
    finally:
        worker.join(timeout=60)
    assert not worker.is_alive()

    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert run.error_code == "cancelled"
    # The lookups hang for 60 s: ending well before that shows the cancel interrupted them (how
    # soon is a figure for a quiet machine, not an assertion on a shared one).
    assert took < 30, f"cancellation took {took:.1f} s"
    steps = {s.node_path: s.status for s in steps_of(run)}
    assert steps == {
        "long@1/inner@1": StepStatus.CANCELLED,
        "long@1/inner@1/triage@1": StepStatus.CANCELLED,
        "long@1/billing@1": StepStatus.CANCELLED,
    }
    assert run.tools_executed == ["lookup_customer", "lookup_customer"]
    assert set(run.tool_calls.values_list("status", flat=True)) == {ToolCallStatus.FAILED}
    # Nothing keeps running unsupervised: no step, no tool after the run settled.
    time.sleep(settings.RUN_HEARTBEAT_SECONDS * 5)
    assert run.tool_calls.count() == 2
    assert not RunStep.objects.filter(run=run, status=StepStatus.RUNNING).exists()
    assert OutboxEmail.objects.count() == 0
    # Both calls were read-only lookups: the cancelled workflow replays without force.
    assert rules.decide(run, force=False).code == "replayable"


@committed
def test_cancelling_during_a_retry_wait_stops_the_wait(settings, alice, observed):
    define(
        "patient",
        [["START", "support"]],
        support={"agent": "support", "retry": {"max_attempts": 3, "initial_delay": 60}},
    )
    run = services.start_run(
        agent_name="patient", message="hi", owner_id="jane", created_by=alice, enqueue=False,
        params={"scripts": {"support": [{"fail": "error", "message": "flaky"}, SAY_DONE]}},
    )
    worker = run_in_thread(run.run_id)
    try:
        wait_until(lambda: run.steps.filter(status=StepStatus.ERROR).exists(), step=0.05, what="the first attempt to fail")
        asked = time.monotonic()
        services.cancel_run(run.run_id, actor=alice)
        worker.join(timeout=30)
        took = time.monotonic() - asked
    finally:
        worker.join(timeout=90)
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert took < settings.RUN_HEARTBEAT_SECONDS * 25
    assert len(observed) == 1, "the retry ran although the run was cancelled"
    (step,) = steps_of(run)
    assert step.attempts == 1
    assert run.tools_executed == []


@committed
def test_a_chat_client_that_goes_away_cancels_a_workflow_turn(alice, demo):
    from asgiref.sync import async_to_sync

    from runs.chat import turns as chat

    turn_run = chat.begin_turn(
        user=alice, agent_name="refund_review", owner_id="jane", message="hi",
        params={"scripts": {"triage": [dict(LOOKUP, hang=60)], "billing": [dict(LOOKUP, hang=60)]}},
    )
    assert turn_run.trigger == Trigger.CHAT

    async def drive() -> None:
        turn = chat.ChatTurn(turn_run)
        turn.start()
        while await turn_run.tool_calls.acount() < 2:
            await asyncio.sleep(0.05)
        turn.abandon()
        await turn.task

    async_to_sync(drive)()
    turn_run.refresh_from_db()
    assert turn_run.status == RunStatus.CANCELLED
    assert turn_run.error_code == outcomes.CLIENT_DISCONNECTED
    assert set(turn_run.steps.values_list("status", flat=True)) == {StepStatus.CANCELLED}


# --- Definitions: validation at every door ------------------------------------------------------------


GOOD_STEPS = {"triage": {"agent": "triage"}, "billing": {"agent": "billing"}, "findings": {"join": True},
              "support": {"agent": "support"}}
GOOD_CHAINS = [["START", ["triage", "billing"], "findings", "support"]]

INVALID = [
    ("empty graph", {"steps": {}, "chains": []}, "The workflow is empty: it has no steps."),
    ("no chains", {"steps": {"triage": {"agent": "triage"}}, "chains": []}, "The workflow has no chains"),
    ("unknown agent", {"steps": {"x": {"agent": "ghost"}}, "chains": [["START", "x"]]},
     "Step “x” uses the agent “ghost”, which is not registered. Registered agents: billing, support, triage."),
    ("unknown function", {"steps": {"x": {"function": "teleport"}}, "chains": [["START", "x"]]},
     "Step “x” uses the function step “teleport”, which is not registered."),
    ("unknown workflow", {"steps": {"x": {"workflow": "nowhere"}}, "chains": [["START", "x"]]},
     "Step “x” runs the workflow “nowhere”, which does not exist."),
    ("unknown step in a chain", {"steps": GOOD_STEPS, "chains": [["START", ["triage", "billing"], "findings", "suport"]]},
     "Chain 1 names the step “suport”, which is not defined in steps."),
    ("cycle", {"steps": {"a": {"agent": "triage"}, "b": {"agent": "support"}}, "chains": [["START", "a", "b", "a"]]},
     "The graph has a cycle: a → b → a."),
    ("dangling join, one branch", {"steps": {"t": {"agent": "triage"}, "j": {"join": True}, "s": {"agent": "support"}},
                                  "chains": [["START", "t", "j", "s"]]},
     "The join “j” is dangling: it follows only t, and a join gathers two or more branches."),
    ("dangling join, nothing after", {"steps": {"t": {"agent": "triage"}, "b": {"agent": "billing"}, "j": {"join": True}},
                                     "chains": [["START", ["t", "b"], "j"]]},
     "The join “j” is dangling: nothing comes after it"),
    ("unreachable step", {"steps": {**GOOD_STEPS, "extra": {"agent": "support"}}, "chains": GOOD_CHAINS},
     "Step “extra” is defined but no chain uses it."),
    ("fan-in without a join", {"steps": {"t": {"agent": "triage"}, "b": {"agent": "billing"}, "s": {"agent": "support"}},
                              "chains": [["START", ["t", "b"], "s"]]},
     "Step “s” follows 2 steps (b, t) but is not a join"),
    ("two ends", {"steps": {"t": {"agent": "triage"}, "b": {"agent": "billing"}}, "chains": [["START", ["t", "b"]]]},
     "The workflow ends in 2 steps (b, t); it must end in one."),
    ("not an object", ["START", "support"], "The graph must be a JSON object"),
]


@pytest.mark.parametrize(("case", "graph", "message"), INVALID, ids=[case for case, _, _ in INVALID])
def test_the_service_refuses_each_kind_of_invalid_definition_naming_the_problem(case, graph, message):
    with pytest.raises(Exception) as caught:
        check_workflow(name="candidate", graph=graph)
    problems = caught.value.message_dict["graph"]
    assert any(message in problem for problem in problems), problems


def test_workflows_that_include_each_other_are_refused():
    define("first", [["START", "t"]], t={"agent": "triage"})
    define("second", [["START", "f"]], f={"workflow": "first"})
    with pytest.raises(Exception) as caught:
        save_workflow(name="first", graph={"steps": {"s": {"workflow": "second"}}, "chains": [["START", "s"]]},
                      instance=WorkflowDefinition.objects.get(name="first"))
    assert caught.value.message_dict["graph"] == [
        "Workflows include each other: first → second → first. A workflow cannot run itself."
    ]
    with pytest.raises(Exception) as caught:
        check_workflow(name="self_ref", graph={"steps": {"s": {"workflow": "self_ref"}}, "chains": [["START", "s"]]})
    assert "self_ref → self_ref" in caught.value.message_dict["graph"][0]


def test_a_workflow_cannot_take_an_agents_name():
    with pytest.raises(Exception) as caught:
        check_workflow(name="support", graph={"steps": GOOD_STEPS, "chains": GOOD_CHAINS})
    assert "A registered agent is already called “support”" in caught.value.message_dict["name"][0]


@pytest.mark.parametrize(("case", "graph", "message"), INVALID[:9], ids=[case for case, _, _ in INVALID[:9]])
def test_the_admin_refuses_invalid_definitions_with_the_message(admin_client, case, graph, message):
    response = admin_client.post(
        "/admin/agents/workflowdefinition/add/",
        {"name": "candidate", "description": "", "graph": json.dumps(graph)},
    )
    assert response.status_code == 200
    page = response.content.decode()
    assert "Please correct the error" in page
    from django.utils.html import escape

    assert escape(message) in page
    assert not WorkflowDefinition.objects.exists()


def test_staff_create_a_workflow_in_the_admin_and_see_its_graph(admin_client):
    response = admin_client.post(
        "/admin/agents/workflowdefinition/add/",
        {"name": "review", "description": "d", "graph": json.dumps({"steps": GOOD_STEPS, "chains": GOOD_CHAINS})},
    )
    assert response.status_code == 302, response.content.decode()[:3000]
    definition = WorkflowDefinition.objects.get(name="review")
    assert definition.updated_by.username == "admin"
    page = admin_client.get(f"/admin/agents/workflowdefinition/{definition.pk}/change/").content.decode()
    assert 'data-step="findings"' in page and "wf-fan" in page


@pytest.mark.parametrize(("case", "graph", "message"), INVALID, ids=[case for case, _, _ in INVALID])
def test_the_api_refuses_invalid_definitions_with_the_message(admin_client, case, graph, message):
    response = admin_client.post(
        "/api/workflows/", {"name": "candidate", "graph": graph}, content_type="application/json"
    )
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "invalid"
    assert any(message in problem for problem in body["errors"]["graph"]), body
    assert message in body["detail"]
    assert not WorkflowDefinition.objects.exists()


def test_the_api_creates_replaces_and_lists_workflows_for_those_allowed(admin_client, alice, client):
    created = admin_client.post("/api/workflows/", DEMO_WORKFLOW, content_type="application/json")
    assert created.status_code == 201, created.json()
    assert created.json()["updated_by"] == "admin"
    replaced = admin_client.put(
        "/api/workflows/refund_review/",
        {"name": "refund_review", "graph": {"steps": GOOD_STEPS, "chains": GOOD_CHAINS}},
        content_type="application/json",
    )
    assert replaced.status_code == 200
    assert replaced.json()["graph"]["chains"] == GOOD_CHAINS

    client.force_login(alice)
    assert [w["name"] for w in client.get("/api/workflows/").json()] == ["refund_review"]
    refused = client.post("/api/workflows/", {**DEMO_WORKFLOW, "name": "mine"}, content_type="application/json")
    assert refused.status_code == 403
    assert client.get("/api/workflows/nothing/").json()["detail"] == "There is no workflow named 'nothing'."


# --- Starting workflow runs through the API ------------------------------------------------------------


@committed
def test_the_api_starts_a_workflow_run_by_agent_or_workflow_and_shows_its_steps(client, alice, demo):
    client.force_login(alice)
    by_agent = client.post(
        "/api/runs/", {"agent": "refund_review", "message": "hi", "owner_id": "jane"}, content_type="application/json"
    )
    assert by_agent.status_code == 202, by_agent.json()
    assert by_agent.json()["trigger"] == "workflow"
    assert by_agent.json()["agent_name"] == "refund_review"
    by_field = client.post(
        "/api/runs/", {"workflow": "refund_review", "message": "hi", "owner_id": "jane"}, content_type="application/json"
    )
    assert by_field.status_code == 202

    run_id = by_field.json()["run_id"]
    executor.execute(run_id)
    detail = client.get(f"/api/runs/{run_id}/").json()
    assert detail["status"] == "success"
    assert [s["step_name"] for s in detail["steps"]][2:] == ["findings", "brief", "support"]
    assert set(detail["steps"][0]) == {
        "seq", "node_path", "step_name", "kind", "target", "status", "attempts", "started_at", "finished_at",
        "output_summary", "error",
    }


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"workflow": "nowhere"}, "workflow", "There is no workflow named 'nowhere'."),
        ({"agent": "refund_review", "workflow": "refund_review"}, "agent", "not both"),
        ({}, "agent", "agent is required"),
        ({"agent": "refund_review", "params": {"script": [SAY_DONE]}}, "params", "give params.scripts"),
        ({"agent": "refund_review", "params": {"scripts": {"ghost": [SAY_DONE]}}}, "params",
         "params.scripts names the agent “ghost”, which this workflow does not run"),
        ({"agent": "refund_review", "params": {"scripts": {"triage": [{"call": "send_email", "args": {}}]}}},
         "params", "params.scripts.triage: Step 1: the agent has no tool named 'send_email'"),
    ],
)
def test_the_api_refuses_bad_workflow_runs(client, alice, demo, body, field, message):
    client.force_login(alice)
    response = client.post("/api/runs/", {"message": "hi", "owner_id": "jane", **body}, content_type="application/json")
    assert response.status_code == 400
    assert any(message in m for m in response.json()["errors"][field]), response.json()
    assert not AgentRun.objects.exists()


@committed
def test_the_run_page_draws_the_graph_with_each_steps_status(admin_client, alice, demo):
    run = run_now(agent_name="refund_review", created_by=alice)
    page = admin_client.get(f"/admin/runs/agentrun/{run.run_id}/change/").content.decode()
    assert "Workflow steps (refund_review)" in page
    assert 'class="wf-step wf-status-success" data-step="support"' in page
    assert page.count('class="step-success"') == 5
    assert "refund_review@1/findings@1" in page
    # The session timeline still shows every agent's calls.
    assert AdkEvent.objects.filter(session_id=run.session_id).exists()


def test_compiling_uses_adks_workflow_primitives(demo):
    from google.adk.workflow import JoinNode, Workflow

    snap = {"name": "refund_review", "graph": demo.graph, "workflows": {}}
    compiled = workflows.compile_workflow(snap, params={}, recorder=None)
    assert isinstance(compiled, Workflow)
    names = {node.name: node for node in compiled.graph.nodes}
    assert isinstance(names["findings"].inner, JoinNode)
    edges = {(edge.from_node.name, edge.to_node.name) for edge in compiled.graph.edges}
    assert edges == {
        ("__START__", "triage"), ("__START__", "billing"), ("triage", "findings"), ("billing", "findings"),
        ("findings", "brief"), ("brief", "support"),
    }


@committed
def test_an_agent_step_that_answers_nothing_fails_the_run_and_the_next_step_never_runs(alice):
    define("quiet", [["START", "triage", "support"]], triage={"agent": "triage"}, support={"agent": "support"})
    run = run_now(
        agent_name="quiet", created_by=alice,
        params={"scripts": {"triage": [{"empty": True}, {"empty": True}, {"empty": True}]}},
    )
    assert run.status == RunStatus.ERROR
    assert run.error_code == "empty_turn"
    assert "Step “triage” (quiet@1/triage@1) failed." in run.error_message
    assert [(s.step_name, s.status) for s in steps_of(run)] == [("triage", StepStatus.ERROR)]
    assert run.tools_executed == []
