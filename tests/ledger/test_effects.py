"""Effects: declared classes, the journal's record of them, keys from stable intent, effect records."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from google.adk.tools import FunctionTool

from agents import tools
from agents.effects import (
    EFFECTFUL,
    IDEMPOTENT,
    READ_ONLY,
    EffectDeclarationError,
    KeyArgumentMissing,
    effect_of_tool,
    idempotent,
    mcp_server_names,
    read_only,
)
from agents.models import CrmNote, OutboxEmail
from runs.execution import executor
from runs.inbox import processing
from runs.ledger import effects
from runs.models.effects import EffectStatus, ToolEffect
from runs.models.inbox import EventStatus, WebhookEvent
from runs.models.ledger import AgentRun, RunStatus
from runs.refusals import CallsInDoubt, RedoNeedsForce, ToolsCalled
from runs.rules import replay as rules
from runs.services import run as services
from tests.factories import API_HINT
from tests.helpers import (
    BASE_DIR,
    EMAIL_ARGS,
    LOOKUP,
    SAY_DONE,
    SEND_EMAIL,
    UPDATE_CRM,
    child_env,
    postgres_only,
    run_now,
    script_params,
)
from tests.kit import api, login

FAIL = {"fail": "error", "message": "The model is down."}
# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
db = pytest.mark.django_db(transaction=True)


def execute(run: AgentRun, *, script: list | None = None) -> AgentRun:
    """Run a queued run in this process, optionally playing another script (a model that answers differently)."""
    if script is not None:
        AgentRun.objects.filter(pk=run.pk).update(config={**run.config, "params": script_params(*script)})
    executor.execute(run.run_id)
    run.refresh_from_db()
    return run


def emails_to_jane() -> int:
    return OutboxEmail.objects.filter(to=EMAIL_ARGS["to"]).count()


# --- Declarations: plain attributes, no Django ---------------------------------------------------------


def test_the_bundled_tools_declare_their_classes():
    assert effect_of_tool(tools.lookup_customer).kind == READ_ONLY
    send, crm = effect_of_tool(tools.send_email), effect_of_tool(tools.update_crm)
    assert (send.kind, send.keyed, crm.kind) == (IDEMPOTENT, True, IDEMPOTENT)
    # The body is in neither the key nor the stable fields: rewriting it is the same email.
    assert send.business_key(EMAIL_ARGS) == {"to": "jane@example.com"}
    assert send.stable_fields({**EMAIL_ARGS, "subject": "  REFUND "}) == {"subject": "refund"}
    assert send.business_key({**EMAIL_ARGS, "to": "Jane@Example.com", "body": "other"}) == send.business_key(EMAIL_ARGS)
    assert crm.business_key({"contact_id": "C-1001", "note": "anything"}) == {"contact_id": "c-1001"}
    with pytest.raises(KeyArgumentMissing):
        send.business_key({"subject": "Refund"})


def test_the_class_is_read_from_any_tool_object_at_call_time():
    @idempotent(key=lambda args: args["invoice"].upper())
    def pay(invoice: str, amount: float) -> dict:
        return {}

    def undeclared(x: int) -> int:
        return x

    assert effect_of_tool(FunctionTool(pay)).kind == IDEMPOTENT
    assert effect_of_tool(FunctionTool(pay)).business_key({"invoice": "inv-7", "amount": 3}) == "INV-7"
    assert effect_of_tool(FunctionTool(read_only(undeclared))).kind == READ_ONLY
    assert effect_of_tool(FunctionTool(lambda y: y)).kind == EFFECTFUL
    assert effect_of_tool(object()).kind == EFFECTFUL
    with pytest.raises(EffectDeclarationError):
        idempotent(key=())
    with pytest.raises(EffectDeclarationError):
        idempotent(key="to", stable=("to",))


def test_mcp_hints_count_only_for_a_trusted_server():
    mcp_types = pytest.importorskip("mcp.types")
    from google.adk.tools.mcp_tool.mcp_session_manager import MCPSessionManager, StdioConnectionParams
    from google.adk.tools.mcp_tool.mcp_tool import McpTool
    from mcp import StdioServerParameters

    def mcp_tool(name: str, **hints) -> McpTool:
        manager = MCPSessionManager(StdioConnectionParams(
            server_params=StdioServerParameters(command=sys.executable, args=["crm_server.py"])
        ))
        raw = mcp_types.Tool(name=name, inputSchema={"type": "object"}, annotations=mcp_types.ToolAnnotations(**hints))
        return McpTool(mcp_tool=raw, mcp_session_manager=manager)

    lookup = mcp_tool("lookup", readOnlyHint=True)
    upsert = mcp_tool("upsert", idempotentHint=True)
    assert "crm_server.py" in mcp_server_names(lookup)
    assert sys.executable not in mcp_server_names(lookup)  # the bare launcher would trust every server
    assert effect_of_tool(lookup, trusted_servers=[]).kind == EFFECTFUL
    assert effect_of_tool(lookup, trusted_servers=["other.py"]).kind == EFFECTFUL
    assert effect_of_tool(lookup, trusted_servers=["crm_server.py"]).kind == READ_ONLY
    trusted_upsert = effect_of_tool(upsert, trusted_servers=["crm_server.py"])
    # The server promises the same arguments have no new effect; the ledger has no key to dedupe by.
    assert (trusted_upsert.kind, trusted_upsert.keyed) == (IDEMPOTENT, False)
    # A hint sent false is said as sent, never as a hint not sent.
    close = effect_of_tool(mcp_tool("close", readOnlyHint=False), trusted_servers=["crm_server.py"])
    assert (close.kind, close.source) == (
        EFFECTFUL, "a server in MCP_TRUSTED_SERVERS that sent readOnlyHint=false, no idempotentHint: effectful, the default"
    )


@pytest.mark.slow
def test_declaring_effects_needs_no_django():
    code = (
        "import sys; import agents.effects as e; "
        "assert not [m for m in sys.modules if m == 'django' or m.startswith('django.')], 'django imported'; "
        "print(e.READ_ONLY)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=BASE_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "read_only"


# --- The journal records the class at call time --------------------------------------------------------


@db
def test_each_call_is_journaled_with_its_effect_class(alice):
    run = run_now(created_by=alice)  # the support agent's default script: lookup, email, CRM note
    assert run.status == RunStatus.SUCCESS
    calls = list(run.tool_calls.order_by("seq"))
    assert [(c.tool_name, c.effect, c.status) for c in calls] == [
        ("lookup_customer", "read_only", "answered"),
        ("send_email", "idempotent", "answered"),
        ("update_crm", "idempotent", "answered"),
    ]
    records = {e.tool_name: e for e in ToolEffect.objects.all()}
    assert set(records) == {"send_email", "update_crm"}  # a read-only call keeps no record
    email = records["send_email"]
    assert (email.status, email.first_run_id, email.first_call_id) == (EffectStatus.DONE, run.run_id, calls[1].call_id)
    assert email.intent_id == f"run:{run.run_id}"
    assert email.result["status"] == "sent"
    assert calls[1].effect_key == email.key

    client = api(alice)
    body = client.get(f"/api/runs/{run.run_id}/").json()
    assert [c["effect"] for c in body["tool_calls"]] == ["read_only", "idempotent", "idempotent"]


# --- §12.2: read-only calls never block a replay ---------------------------------------------------------


@db
def test_a_failed_run_that_only_read_replays_without_force_through_the_api(alice):
    failed = run_now(params=script_params(LOOKUP, FAIL), created_by=alice)
    assert failed.tools_executed == ["lookup_customer"]
    client = api(alice)
    decision = client.get(f"/api/runs/{failed.run_id}/").json()["replay_decision"]
    assert (decision["allowed"], decision["code"]) == (True, "replayable")
    assert decision["preview"][0]["reuse"] == "runs again"
    response = client.post(f"/api/runs/{failed.run_id}/replay/", {}, format="json")
    assert response.status_code == 202, response.json()
    assert response.json()["forced"] is False and response.json()["effects"] == "reuse"


@db
def test_a_failed_run_that_only_read_replays_without_force_through_the_admin(no_worker, support_lead):
    failed = run_now(params=script_params(LOOKUP, LOOKUP, FAIL))
    client = login(support_lead)
    response = client.post("/admin/runs/agentrun/", {"action": "replay_selected", "_selected_action": [str(failed.pk)]},
                           follow=True)
    replay = AgentRun.objects.get(replay_of=failed)
    assert replay.forced is False
    assert [m.message for m in response.context["messages"]] == [
        f"support run {str(failed.run_id)[:8]}: Replayed as run {str(replay.run_id)[:8]}."
    ]


@db
def test_a_webhook_attempt_that_only_read_is_retried(no_inbox_worker, settings, tmp_path):
    from tests.inbox.test_webhooks import deliver, make_source

    settings.WEBHOOK_ATTACHMENTS_DIR = tmp_path / "webhook-attachments"
    make_source(script=[LOOKUP, FAIL], expects_attachments=False)
    event_id = deliver().json()["event_id"]

    assert processing.process_event(event_id=event_id) == EventStatus.RETRY_WAIT
    event = WebhookEvent.objects.get(pk=event_id)
    assert "called no tool that acts (only read-only ones), so it is retried" in event.last_error


@db
def test_tools_called_names_only_the_calls_that_may_act_word_for_word():
    failed = run_now(params=script_params(LOOKUP, SEND_EMAIL, LOOKUP, FAIL))
    assert failed.tools_executed == ["lookup_customer", "send_email", "lookup_customer"]
    refusal = rules.decide(failed, force=False).refusal
    assert isinstance(refusal, ToolsCalled)
    assert refusal.detail == (
        f"This run already called send_email before failing: a replay would call it again. {API_HINT}"
    )
    assert refusal.context["tools"] == ["send_email"]


# --- §12.3: keys from stable intent ---------------------------------------------------------------------


@db
def test_a_forced_replay_reuses_recorded_effects_by_default(alice, support_lead):
    original = run_now(params=script_params(LOOKUP, SEND_EMAIL, UPDATE_CRM, FAIL), created_by=alice)
    assert (emails_to_jane(), CrmNote.objects.count()) == (1, 1)

    replay = services.replay_run(original.run_id, actor=support_lead, force=True, reason="finish the run")
    replay = execute(replay, script=[LOOKUP, SEND_EMAIL, UPDATE_CRM, SAY_DONE])

    assert replay.status == RunStatus.SUCCESS and replay.effects == "reuse"
    assert (emails_to_jane(), CrmNote.objects.count()) == (1, 1)
    calls = list(replay.tool_calls.order_by("seq"))
    assert [(c.tool_name, c.status) for c in calls] == [
        ("lookup_customer", "answered"), ("send_email", "deduplicated"), ("update_crm", "deduplicated")]
    # The model was served what the first call answered.
    first_email = original.tool_calls.get(tool_name="send_email")
    assert json.loads(calls[1].response_summary) == json.loads(first_email.response_summary)
    assert ToolEffect.objects.get(key=calls[1].effect_key).first_run_id == original.run_id

    client = api(support_lead)
    body = client.get(f"/api/runs/{replay.run_id}/").json()
    assert [c["status"] for c in body["tool_calls"]] == ["answered", "deduplicated", "deduplicated"]
    admin = login(support_lead)
    html = admin.get(f"/admin/runs/agentrun/{replay.run_id}/change/").content.decode()
    assert "served from its record, not run again" in html


@db
def test_a_replay_whose_model_rewrites_the_body_is_still_deduplicated(support_lead):
    original = run_now(params=script_params(SEND_EMAIL, FAIL))
    replay = services.replay_run(original.run_id, actor=support_lead, force=True, reason="finish it")
    rewritten = {"call": "send_email", "args": {**EMAIL_ARGS, "to": "JANE@example.com ",
                                                "body": "Dear Jane, good news: your refund is on its way!"}}
    replay = execute(replay, script=[rewritten, SAY_DONE])
    assert replay.status == RunStatus.SUCCESS
    assert emails_to_jane() == 1
    assert replay.tool_calls.get().status == "deduplicated"


@db
def test_the_same_key_with_another_subject_is_refused_to_the_model_and_recorded(support_lead):
    original = run_now(params=script_params(SEND_EMAIL, FAIL))
    replay = services.replay_run(original.run_id, actor=support_lead, force=True, reason="finish it")
    other = {"call": "send_email", "args": {**EMAIL_ARGS, "subject": "Something else entirely"}}
    replay = execute(replay, script=[other, SAY_DONE])

    assert replay.status == RunStatus.SUCCESS  # the model was told, and went on
    assert emails_to_jane() == 1
    call = replay.tool_calls.get()
    assert call.status == "refused"
    assert "already done in this request with" in call.response_summary
    assert 'subject\\": \\"refund' in call.response_summary and "something else entirely" in call.response_summary
    # A refused call did nothing: replaying that run again is not refused for it.
    assert rules.decide(replay, force=True).overridden.code == "run_succeeded"


@db
def test_redoing_the_effects_sends_the_email_again_and_is_recorded(support_lead):
    original = run_now(params=script_params(SEND_EMAIL, FAIL))
    redo = services.replay_run(original.run_id, actor=support_lead, force=True, reason="it bounced", effects="redo")
    assert redo.effects == "redo"
    redo = execute(redo, script=[SEND_EMAIL, SAY_DONE])
    assert emails_to_jane() == 2
    assert redo.tool_calls.get().status == "answered"
    assert effects.intent_id(redo) == f"run:{redo.run_id}"
    from django.contrib.admin.models import LogEntry

    assert LogEntry.objects.filter(object_id=str(redo.run_id), change_message__contains="effects: redo the effects").exists()

    # A replay of the redo reuses the redo's effects, not the original's.
    again = services.replay_run(redo.run_id, actor=support_lead, force=True, reason="once more")
    assert effects.intent_id(again) == f"run:{redo.run_id}"
    execute(again, script=[SEND_EMAIL, SAY_DONE])
    assert emails_to_jane() == 2


@db
def test_redo_needs_force(alice):
    failed = run_now(params=script_params(FAIL), created_by=alice)
    with pytest.raises(RedoNeedsForce):
        services.replay_run(failed.run_id, actor=alice, effects="redo")
    client = api(alice)
    response = client.post(f"/api/runs/{failed.run_id}/replay/", {"effects": "redo"}, format="json")
    assert response.status_code == 400 and response.json()["code"] == "redo_needs_force"
    response = client.post(f"/api/runs/{failed.run_id}/replay/", {"effects": "twice"}, format="json")
    assert response.status_code == 400
    assert AgentRun.objects.count() == 1


@db
def test_a_tool_that_raised_after_acting_leaves_its_effect_in_doubt(support_lead):
    # The tool sends the email, then raises: whether it acted is unknown to the ledger.
    original = run_now(params=script_params(dict(SEND_EMAIL, tool_fails="SMTP said 451 after queueing")))
    assert (original.status, original.error_code) == (RunStatus.ERROR, "tool_failed")
    record = ToolEffect.objects.get()
    assert record.status == EffectStatus.STARTED
    assert "SMTP said 451" in record.error
    refusal = rules.decide(original, force=False).refusal
    assert isinstance(refusal, CallsInDoubt)
    assert refusal.context["tools"] == ["send_email"]
    assert refusal.detail.startswith("This run's call to send_email is in doubt: it was started and never finished")

    preview = rules.describe_now(original)["preview"]
    assert [(p["tool_name"], p["reuse"], p["redo"]) for p in preview] == [("send_email", "needs a person", "runs again")]

    # Forced, reusing effects: the call is not run again and the replay fails, naming it.
    replay = services.replay_run(original.run_id, actor=support_lead, force=True, reason="try again")
    replay = execute(replay, script=[SEND_EMAIL, SAY_DONE])
    assert (replay.status, replay.error_code) == (RunStatus.ERROR, "effect_in_doubt")
    first_call = original.tool_calls.get().call_id
    assert first_call in replay.error_message and "send_email" in replay.error_message
    assert emails_to_jane() == 1
    not_run = replay.tool_calls.get()
    assert not_run.status == "failed" and not_run.response_summary.startswith("not run:")


@db
def test_effect_keys_come_from_the_intent_never_from_call_ids_or_all_arguments(support_lead):
    original = run_now(params=script_params(SEND_EMAIL, FAIL))
    replay = services.replay_run(original.run_id, actor=support_lead, force=True, reason="again")
    assert effects.intent_id(original) == effects.intent_id(replay) == f"run:{original.run_id}"
    key = effects.effect_key(intent=f"run:{original.run_id}", tool="send_email", business_key={"to": "jane@example.com"})
    assert original.tool_calls.get().effect_key == key
    assert len({key, effects.effect_key(intent=f"run:{replay.run_id}", tool="send_email",
                                        business_key={"to": "jane@example.com"})}) == 2


@db
def test_a_webhook_runs_intent_is_its_event(no_inbox_worker, settings, tmp_path):
    from tests.inbox.test_webhooks import deliver, make_source

    settings.WEBHOOK_ATTACHMENTS_DIR = tmp_path / "webhook-attachments"
    source = make_source(script=[SEND_EMAIL, SAY_DONE], expects_attachments=False)
    event_id = deliver(message_id="provider-42").json()["event_id"]
    assert processing.process_event(event_id=event_id) == EventStatus.DONE
    run = AgentRun.objects.get(webhook_event_id=event_id)
    assert effects.intent_id(run) == f"webhook:{source.pk}:provider-42"
    assert ToolEffect.objects.get().intent_id == f"webhook:{source.pk}:provider-42"


@db
def test_the_force_replay_page_asks_reuse_or_redo_and_previews_each_call(no_worker, support_lead):
    failed = run_now(params=script_params(LOOKUP, SEND_EMAIL, FAIL))
    client = login(support_lead)
    form = {"action": "force_replay_selected", "_selected_action": [str(failed.pk)]}
    html = client.post("/admin/runs/agentrun/", form).content.decode()
    assert 'name="effects" value="reuse" checked' in html
    assert 'name="effects" value="redo"' in html
    assert "Replay, reusing recorded effects" in html and "Replay and redo the effects" in html
    email_call = failed.tool_calls.get(tool_name="send_email").call_id
    assert f'id="preview-{email_call}"' in html
    assert "served from record" in html

    client.post("/admin/runs/agentrun/", {**form, "post": "yes", "reason": "bounced", "effects": "redo"})
    replay = AgentRun.objects.get(replay_of=failed)
    assert (replay.forced, replay.effects) == (True, "redo")
    html = client.post("/admin/runs/agentrun/", {**form, "post": "yes", "reason": "x", "effects": "twice"}).content
    assert "Choose one of the options" in html.decode()
    assert AgentRun.objects.filter(replay_of=failed).count() == 1


@db
def test_permission_names_exist_for_the_settle_door():
    assert Permission.objects.filter(codename="settle_toolcall", content_type__app_label="runs").exists()


# --- Concurrency (PostgreSQL, real processes) -------------------------------------------------------------


@pytest.mark.slow
@postgres_only
@db
def test_concurrent_forced_replays_of_one_intent_send_one_email(support_lead):
    """Many people force replays at once, and the replays run in separate worker processes."""
    first = run_now(params=script_params(FAIL))
    second = execute(services.replay_run(first.run_id, actor=support_lead), script=[FAIL])
    assert effects.intent_id(second) == effects.intent_id(first)

    # 8 simultaneous requests, half for each run of the chain: one replay each gets through.
    barrier = threading.Barrier(8)
    created: list[AgentRun] = []
    refused: list[Exception] = []
    lock = threading.Lock()

    def force(target: AgentRun) -> None:
        try:
            connection.ensure_connection()
            barrier.wait(timeout=60)
            try:
                replay = services.replay_run(target.run_id, actor=support_lead, force=True, reason="race")
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                with lock:
                    refused.append(exc)
            else:
                with lock:
                    created.append(replay)
        finally:
            connection.close()

    threads = [threading.Thread(target=force, args=(target,)) for target in [first, second] * 4]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(created) == 2 and {r.replay_of_id for r in created} == {first.run_id, second.run_id}
    assert len(refused) == 6 and {getattr(r, "code", "") for r in refused} == {"replay_in_flight"}

    # Both replays share the intent, so they race for the email's key in two worker processes;
    # the winner holds the key a moment inside the tool, so the other sees it `started`.
    scripts = {created[0].run_id: [dict(SEND_EMAIL, hang=1.5), SAY_DONE], created[1].run_id: [SEND_EMAIL, SAY_DONE]}
    for run_id, script in scripts.items():
        AgentRun.objects.filter(pk=run_id).update(config={"message": "Email Jane.", "params": script_params(*script)})
    workers = [
        subprocess.Popen([sys.executable, "-c", f"import django; django.setup()\nfrom runs.execution import executor\n"
                          f"executor.execute({str(run_id)!r})"], cwd=BASE_DIR, env=child_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for run_id in scripts
    ]
    for worker in workers:
        _, stderr = worker.communicate(timeout=120)
        assert worker.returncode == 0, stderr.decode()[-3000:]

    assert emails_to_jane() == 1
    record = ToolEffect.objects.get()
    assert record.status == EffectStatus.DONE
    outcomes = {run.run_id: (run.status, run.error_code) for run in AgentRun.objects.filter(pk__in=list(scripts))}
    winner = outcomes.pop(record.first_run_id)
    assert winner == (RunStatus.SUCCESS, "")
    # The other was either served the record (it came second) or stopped while the first was at work.
    assert list(outcomes.values())[0] in {(RunStatus.SUCCESS, ""), (RunStatus.ERROR, "effect_in_doubt")}


@db
def test_effect_records_are_browsable_read_only(support_lead, django_user_model):
    run = run_now(params=script_params(SEND_EMAIL, FAIL))
    record = ToolEffect.objects.get()
    admin_user = django_user_model.objects.create_superuser("root-desk")
    client = login(admin_user)
    listing = client.get("/admin/runs/tooleffect/").content.decode()
    assert "send_email" in listing and str(run.run_id)[:8] in listing
    page = client.get(f"/admin/runs/tooleffect/{record.pk}/change/")
    assert page.status_code == 200 and record.key in page.content.decode()
    assert client.post(f"/admin/runs/tooleffect/{record.pk}/delete/").status_code == 403
    assert ToolEffect.objects.filter(pk=record.pk).exists()


@pytest.mark.django_db
def test_a_claim_whose_connection_broke_takes_its_own_record_and_nothing_else():
    from tests.factories import make_run

    run, other = make_run(), make_run()
    claim = dict(intent=f"run:{run.run_id}", tool="send_email", business_key="j@x", stable_fields={})
    first = effects.claim_effect(run_id=run.run_id, call_id="call-1", **claim)
    assert first.kind == "run"
    # Asked again without knowing the first claim committed: only this very call's record is its own.
    assert effects.claim_effect(run_id=run.run_id, call_id="call-1", own_claim_may_exist=True, **claim).kind == "run"
    assert effects.claim_effect(run_id=run.run_id, call_id="call-2", own_claim_may_exist=True, **claim).kind == "in_doubt"
    assert effects.claim_effect(run_id=other.run_id, call_id="call-1", own_claim_may_exist=True, **claim).kind == "in_doubt"
    # Without that word, a started record is a doubt even for its own call.
    assert effects.claim_effect(run_id=run.run_id, call_id="call-1", **claim).kind == "in_doubt"
    assert ToolEffect.objects.get(key=first.key).status == EffectStatus.STARTED
