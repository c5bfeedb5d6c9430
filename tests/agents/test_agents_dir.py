"""Agents loaded from AGENTS_DIR by ADK's loader, wrapped per run without being changed."""

from __future__ import annotations

import threading

import pytest
from django.core.management import call_command
from google.adk.agents import LlmAgent
from google.adk.tools.agent_tool import AgentTool
from rest_framework.test import APIClient

from agents import diet, loading, registry, services
from agents.models import AdkEvent, OutboxEmail
from agents.retrying import RetryingLlm
from agents.scripted import ScriptedLlm
from runs.inputs.sources import source_errors
from runs.models.inbox import WebhookSource
from runs.models.ledger import AgentRun, RunStatus, ToolCall, ToolCallStatus
from tests.helpers import EMAIL_ARGS, SAY_DONE, package_source, run_now
from tests.kit import api_as

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed

BROKEN = 'from google.adk.agents import LlmAgent\n\nroot_agent = LlmAgent(name="broken", model="gemini-2.5-flash"\n'

LOOKUP_A1 = {"call": "lookup_order", "args": {"order_id": "A-1"}}
DESK_SCRIPTS = {
    # Two calls in one turn: a function and an agent wrapped as a tool; then a transfer.
    "desk": [
        [LOOKUP_A1, {"call": "summarizer", "args": {"request": "Summarise order A-1."}}],
        {"call": "transfer_to_agent", "args": {"agent_name": "refunds"}},
    ],
    "summarizer": [{"call": "word_count", "args": {"text": "order A-1 delivered"}}, {"say": "A-1: delivered."}],
    "refunds": [
        {"call": "issue_refund", "args": {"order_id": "A-1", "amount": 5}},
        {"call": "transfer_to_agent", "args": {"agent_name": "research"}},
    ],
    # The ParallelAgent's two children run side by side.
    "carrier_check": [{"call": "check_carrier", "args": {"order_id": "A-1"}}, {"say": "At the door."}],
    "ledger_check": [LOOKUP_A1, {"say": "Delivered, 42."}],
}



@pytest.fixture
def desk(agents_dir):
    return agents_dir(desk=package_source("desk"))["desk"]


def _journal(run: AgentRun) -> list[tuple[str, str]]:
    return [(c.agent_name, c.tool_name) for c in ToolCall.objects.filter(run=run).order_by("seq")]


# --- Loading ---------------------------------------------------------------------------------------


def test_the_bundled_agents_are_ordinary_packages_loaded_by_adks_loader(settings):
    assert settings.AGENTS_DIR == [str(settings.BASE_DIR / "agents" / "bundled")]
    assert registry.runnable_agents() == ["billing", "support", "triage"]
    support = registry.get_agent_spec("support")
    assert support.path.endswith("agents/bundled/support")
    assert [(t.name, t.source) for t in support.tools] == [
        ("lookup_customer", "function"), ("send_email", "function"), ("update_crm", "function"),
        ("issue_refund", "function"), ("request_return_label", "function"), ("preload_memory", "builtin"),
    ]
    assert support.default_script[-1]["say"].startswith("I looked Jane up")
    # The package itself is what `adk web` would load: a plain LlmAgent with its declared model.
    assert isinstance(support.root, LlmAgent) and support.root.model == "gemini-2.5-flash"


def test_a_multi_agent_tree_is_described_with_sources_sub_agents_and_transfers(desk):
    tree = desk.tree
    assert (tree.name, tree.kind) == ("desk", "LlmAgent")
    assert [(t.name, t.source, t.detail) for t in tree.tools] == [
        ("lookup_order", "function", ""), ("summarizer", "agent", "summarizer"),
    ]
    assert [(child.name, child.kind) for child in tree.sub_agents] == [("refunds", "LlmAgent"), ("research", "ParallelAgent")]
    assert [child.name for child in tree.sub_agents[1].sub_agents] == ["carrier_check", "ledger_check"]
    assert [child.name for child in tree.tool_agents] == ["summarizer"]
    assert tree.transfer_targets == ("refunds", "research")
    assert sorted(desk.llm_agents) == ["carrier_check", "desk", "ledger_check", "refunds", "summarizer"]
    assert desk.default_script == ({"call": "lookup_order", "args": {"order_id": "A-1"}}, {"say": "Order A-1 was delivered."})


@committed
def test_a_package_with_a_syntax_error_is_listed_with_its_error_and_the_others_run(agents_dir, alice, caplog):
    specs = agents_dir(broken=BROKEN, desk=package_source("desk"))
    assert "SyntaxError" in specs["broken"].load_error
    assert specs["broken"].tree is None
    assert "broken" not in registry.runnable_agents()
    assert any("broken" in record.getMessage() and "SyntaxError" in record.getMessage() for record in caplog.records)

    client = api_as(alice)
    listed = {agent["name"]: agent for agent in client.get("/api/agents/").json()}
    assert "SyntaxError" in listed["broken"]["load_error"]
    assert listed["desk"]["load_error"] == ""
    refused = client.post("/api/runs/", {"agent": "broken", "message": "hi", "owner_id": "jane"}, format="json")
    assert refused.status_code == 400
    assert "could not be loaded" in refused.json()["errors"]["agent"][0]

    run = run_now(agent_name="desk", message="Where is A-1?")
    assert run.status == RunStatus.SUCCESS, run.error_message
    assert run.result == "Order A-1 was delivered."


# --- Running any tree ------------------------------------------------------------------------------


@committed
def test_a_multi_agent_tree_runs_and_each_call_is_journaled_with_its_agent(desk):
    run = run_now(agent_name="desk", message="Refund A-1 and check the parcel.", params={"scripts": DESK_SCRIPTS})

    assert run.status == RunStatus.SUCCESS, run.error_message
    journal = _journal(run)
    assert journal[:6] == [
        ("desk", "lookup_order"),
        ("desk", "summarizer"),
        ("summarizer", "word_count"),  # inside the AgentTool's own session, journaled all the same
        ("desk", "transfer_to_agent"),
        ("refunds", "issue_refund"),
        ("refunds", "transfer_to_agent"),
    ]
    # The ParallelAgent's children run concurrently: both calls are there, in either order.
    assert sorted(journal[6:]) == [("carrier_check", "check_carrier"), ("ledger_check", "lookup_order")]
    assert all(call.status == ToolCallStatus.ANSWERED for call in ToolCall.objects.filter(run=run))
    assert run.tools_executed == [tool for _, tool in journal]
    assert sorted(run.result.splitlines()) == ["At the door.", "Delivered, 42."]

    # The two calls of the first turn were one model turn: one stored event holds both.
    first = next(e for e in AdkEvent.objects.filter(session_id=run.session_id).order_by("timestamp") if e.function_calls)
    assert [c["name"] for c in first.function_calls] == ["lookup_order", "summarizer"]


def test_every_llm_agent_of_a_run_is_wrapped_and_the_loaded_tree_is_untouched(desk):
    before = desk.root.model_dump(exclude={"sub_agents", "tools", "parent_agent"})
    root = registry.build_agent(desk, params={"scripts": DESK_SCRIPTS})

    agents = list(loading.walk_agents(root))
    llm_agents = [agent for agent in agents if isinstance(agent, LlmAgent)]
    assert sorted(agent.name for agent in llm_agents) == sorted(desk.llm_agents)
    for agent in llm_agents:
        assert isinstance(agent.model, RetryingLlm)
        assert isinstance(agent.model.inner, ScriptedLlm)
        assert agent.model.inner.script == DESK_SCRIPTS[agent.name]
        assert agent.canonical_before_model_callbacks[0] is diet.strip_old_payloads
    # The AgentTool of the run wraps the run's copy of its agent, not the loaded one.
    run_tool = next(tool for tool in root.tools if isinstance(tool, AgentTool))
    loaded_tool = next(tool for tool in desk.root.tools if isinstance(tool, AgentTool))
    assert run_tool is not loaded_tool and run_tool.agent is not loaded_tool.agent

    # Nothing of the loaded definition changed, and no object of the run is shared with it.
    loaded_agents = list(loading.walk_agents(desk.root))
    assert all(isinstance(agent.model, str) for agent in loaded_agents if isinstance(agent, LlmAgent))
    assert not {id(agent) for agent in agents} & {id(agent) for agent in loaded_agents}
    assert desk.root.model_dump(exclude={"sub_agents", "tools", "parent_agent"}) == before
    assert desk.root.sub_agents[0].parent_agent is desk.root
    assert desk.root.before_model_callback is None


def test_with_a_key_each_agent_keeps_its_declared_model_unless_agent_model_names_one(desk, settings):
    from google.adk.models.google_llm import Gemini

    settings.AGENT_MODEL = ""
    root = registry.build_agent(desk, params={})
    assert {agent.model.inner.model for agent in loading.walk_agents(root) if isinstance(agent, LlmAgent)} == {"gemini-2.5-flash"}
    assert all(isinstance(agent.model.inner, Gemini) for agent in loading.walk_agents(root) if isinstance(agent, LlmAgent))

    settings.AGENT_MODEL = "gemini-2.0-flash"
    root = registry.build_agent(desk, params={})
    assert {agent.model.inner.model for agent in loading.walk_agents(root) if isinstance(agent, LlmAgent)} == {"gemini-2.0-flash"}


@committed
def test_tools_called_with_bad_arguments_answer_with_an_error_and_the_run_goes_on(desk):
    run = run_now(agent_name="desk", message="Refund A-1.", params={"scripts": {
        "desk": [{"call": "transfer_to_agent", "args": {"agent_name": "refunds"}}],
        # No order_id, and an amount of the wrong type and name.
        "refunds": [{"call": "issue_refund", "args": {"amount_eur": "five"}}, {"say": "I could not refund it."}],
    }})

    assert run.status == RunStatus.SUCCESS, run.error_message
    call = ToolCall.objects.get(run=run, tool_name="issue_refund")
    assert (call.agent_name, call.status) == ("refunds", ToolCallStatus.ANSWERED)
    assert call.args == {"amount_eur": "five"}
    assert "mandatory input parameters are not present" in call.response_summary
    assert run.result == "I could not refund it."


@committed
def test_two_concurrent_runs_of_one_agent_play_their_own_scripts(agents_dir):
    agents_dir(mailer=package_source("mailer"))

    def script(email: str) -> list:
        # The lookup hangs so that both runs are in their tools at the same time.
        return [
            {"call": "lookup_customer", "args": {"email": email}, "hang": 1.0},
            {"call": "send_email", "args": dict(EMAIL_ARGS, to=email)},
            {"say": f"Wrote to {email}."},
        ]

    runs: dict[str, AgentRun] = {}

    def start(email: str) -> None:
        runs[email] = run_now(agent_name="mailer", message=f"Email {email}", params={"script": script(email)})

    threads = [threading.Thread(target=start, args=(email,)) for email in ("ann@example.com", "bob@example.com")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    ann, bob = runs["ann@example.com"], runs["bob@example.com"]
    assert ann.status == bob.status == RunStatus.SUCCESS, (ann.error_message, bob.error_message)
    # They overlapped on the one agent loop of this process.
    assert ann.started_at < bob.finished_at and bob.started_at < ann.finished_at
    for run, email in ((ann, "ann@example.com"), (bob, "bob@example.com")):
        assert [(c.tool_name, c.args.get("email") or c.args.get("to")) for c in run.tool_calls.order_by("seq")] == [
            ("lookup_customer", email), ("send_email", email),
        ]
        assert list(OutboxEmail.objects.filter(run_id=run.run_id).values_list("to", flat=True)) == [email]
        assert run.result == f"Wrote to {email}."


# --- Scripts for any agent of the tree: refused at the door with 400 ------------------------------------


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"scripts": {"nobody": [SAY_DONE]}}, "params.scripts names the agent 'nobody', which is not a model-driven agent of 'desk'"),
        ({"scripts": {"research": [SAY_DONE]}}, "'research', which is not a model-driven agent"),
        ({"scripts": {"refunds": [{"call": "word_count", "args": {}}]}}, "params.scripts.refunds: Step 1: the agent has no tool named 'word_count'"),
        ({"scripts": {"summarizer": [{"say": 3}]}}, "params.scripts.summarizer: Step 1: a say step is"),
        ({"scripts": {"desk": [{"call": "transfer_to_agent", "args": {"agent_name": "summarizer"}}]}},
         "params.scripts.desk: Step 1: transfer_to_agent needs args.agent_name, one of refunds, research (got 'summarizer')"),
        ({"scripts": {"summarizer": [{"call": "transfer_to_agent", "args": {"agent_name": "desk"}}]}},
         "the agent has no tool named 'transfer_to_agent'"),
        ({"script": [{"call": "issue_refund", "args": {}}]}, "params.script: Step 1: the agent has no tool named 'issue_refund'"),
        ({"scripts": ["not", "an", "object"]}, "params.scripts must be an object"),
    ],
)
def test_bad_scripts_are_refused_with_400_naming_the_agent_and_the_step(desk, alice, params, words):
    response = api_as(alice).post(
        "/api/runs/", {"agent": "desk", "message": "hi", "owner_id": "jane", "params": params}, format="json"
    )
    assert response.status_code == 400, response.json()
    assert words in response.json()["errors"]["params"][0]
    assert not AgentRun.objects.exists()


def test_a_good_script_for_a_sub_agent_is_accepted(desk, alice):
    response = api_as(alice).post(
        "/api/runs/", {"agent": "desk", "message": "hi", "owner_id": "jane", "params": {"scripts": DESK_SCRIPTS}}, format="json"
    )
    assert response.status_code == 202, response.json()


# --- Doors -----------------------------------------------------------------------------------------------


def test_the_api_lists_loaded_agents_with_their_tree(desk, alice):
    client = api_as(alice)
    listed = client.get("/api/agents/")
    assert listed.status_code == 200
    assert [agent["name"] for agent in listed.json()] == ["billing", "desk", "support", "triage"]

    body = client.get("/api/agents/desk/").json()
    assert body["description"] == "Routes a customer's request to refunds or research."
    assert body["load_error"] == "" and body["has_default_script"] is True
    assert body["tools"][1] == {
        "name": "summarizer", "source": "agent", "detail": "summarizer", "effect": "effectful",
        "effect_reason": "an agent used as a tool: effectful, as its own tools may be", "annotations": {},
    }
    tree = body["tree"]
    assert [child["name"] for child in tree["sub_agents"]] == ["refunds", "research"]
    assert [child["name"] for child in tree["sub_agents"][1]["sub_agents"]] == ["carrier_check", "ledger_check"]
    assert tree["tool_agents"][0]["tools"][0]["name"] == "word_count"
    assert tree["transfer_targets"] == ["refunds", "research"]

    assert client.get("/api/agents/nobody/").json()["code"] == "not_found"
    assert APIClient().get("/api/agents/").status_code == 401


def test_the_admin_shows_loaded_agents_to_staff_only(agents_dir, admin_client, client, alice):
    agents_dir(broken=BROKEN, desk=package_source("desk"))
    index = admin_client.get("/admin/")
    assert b"/admin/agents-loaded/" in index.content
    page = admin_client.get("/admin/agents-loaded/")
    assert page.status_code == 200
    html = page.content.decode()
    for words in ("desk", "summarizer", "carrier_check", "ParallelAgent", "May transfer to: refunds, research", "SyntaxError", "not loaded"):
        assert words in html
    client.force_login(alice)  # not staff
    assert client.get("/admin/agents-loaded/").status_code == 302


@committed
def test_workflows_webhook_sources_and_run_agent_take_any_loaded_agent(desk, capsys):
    graph = {"steps": {"route": {"agent": "desk"}}, "chains": [["START", "route"]]}
    name, _ = services.check_workflow(name="desk_flow", graph=graph)
    assert name == "desk_flow"
    source = WebhookSource(slug="orders", name="Orders", agent_name="desk", owner_id="ops", message_id_header="X-Id",
                           secret="s" * 20, params={"scripts": {"refunds": [SAY_DONE]}})
    assert source_errors(source) == {}
    source.params = {"scripts": {"nobody": [SAY_DONE]}}
    assert "nobody" in source_errors(source)["params"][0]

    call_command("run_agent", "desk", "Where is A-1?", "--owner", "alice", "--inline")
    run = AgentRun.objects.get(agent_name="desk")
    assert run.status == RunStatus.SUCCESS
    assert run.tools_executed == ["lookup_order"]


@committed
def test_a_workflow_scripts_the_sub_agents_of_its_agent_steps(desk):
    from runs.services import run as run_services

    services.save_workflow(name="desk_flow", graph={"steps": {"route": {"agent": "desk"}}, "chains": [["START", "route"]]})
    run = run_services.start_run(agent_name="desk_flow", message="Refund A-1", owner_id="alice", enqueue=False,
                                 params={"scripts": {"desk": [{"call": "transfer_to_agent", "args": {"agent_name": "refunds"}}],
                                                     "refunds": [{"say": "Refunded."}]}})
    from runs.execution import executor

    executor.execute(run.run_id)
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCESS, run.error_message
    assert _journal(run) == [("desk", "transfer_to_agent")]
    with pytest.raises(Exception, match="which this workflow does not run"):
        run_services.start_run(agent_name="desk_flow", message="x", owner_id="alice", enqueue=False,
                               params={"scripts": {"nobody": [SAY_DONE]}})
