"""Resume instead of replay: a failed run continued in its own session (docs/architecture.md, "Resume rules").

In-process tests stop a run at the second model call (the model raises, as a dead provider
would); the crash cases, where a worker process is SIGKILLed at a point, are in
`tests/processes/test_resume_crash.py` on PostgreSQL.
"""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.utils import timezone

from agents import scripted
from agents.models import CrmNote, OutboxEmail
from agents.scripted import ScriptedLlm
from config.lib.refusals import Refusal
from memory.models import MemoryEntry
from runs.execution import executor
from runs.ledger import effects, timeline
from runs.models.effects import ToolEffect
from runs.models.ledger import AgentRun, RunStatus
from runs.refusals import ResumeNotPermitted
from runs.rules import overview, resume
from runs.rules import replay as rules
from runs.services import decisions
from runs.services import run as services
from runs.upkeep import retention
from tests import kit
from tests.factories import make_run
from tests.helpers import LOOKUP, SAY_DONE, SEND_EMAIL, UPDATE_CRM, postgres_only, run_now, script_params
from tests.kit import login

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
db = pytest.mark.django_db(transaction=True)
SCRIPT = [SEND_EMAIL, UPDATE_CRM, {"say": "Emailed Jane and noted it."}]


def execute(run: AgentRun) -> AgentRun:
    executor.execute(run.run_id)
    run.refresh_from_db()
    return run


@db
def test_a_run_stopped_after_send_email_resumes_with_update_crm_only(alice, model_down_at_second_call, requests_seen):
    original = run_now(params=script_params(*SCRIPT), created_by=alice)
    assert (original.status, original.tools_executed) == (RunStatus.ERROR, ["send_email"])
    model_down_at_second_call()
    requests_seen.clear()  # only what the model is asked from here on
    resumed = execute(services.resume_run(original.run_id, actor=alice))
    assert resumed.status == RunStatus.SUCCESS, resumed.error_message
    assert resumed.tools_executed == ["update_crm"]
    assert resumed.session_id == original.session_id and resumed.resume_of_id == original.run_id
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 1
    # The call it made obeyed every rule: journaled with its class, its record under the original's intent.
    (crm,) = resumed.tool_calls.all()
    assert (crm.tool_name, crm.effect, crm.status) == ("update_crm", "idempotent", "answered")
    assert ToolEffect.objects.get(key=crm.effect_key).intent_id == f"run:{original.run_id}"
    history = [part.function_response.response for content in requests_seen[0].contents for part in content.parts
               if part.function_response]
    assert history and history[0]["status"] == "sent"
    assert resumed.result == "Emailed Jane and noted it."


@db
def test_a_run_that_had_answered_before_it_stopped_resumes_to_that_answer_without_the_model(alice, requests_seen):
    # Killed after the final answer was stored, before the run was settled (the sweep then records
    # it as an error): the answer stands, so the resume settles with it and asks the model nothing.
    answered = run_now(params=script_params(SEND_EMAIL, UPDATE_CRM, {"say": "Emailed Jane and noted it."}),
                       created_by=alice)
    AgentRun.objects.filter(pk=answered.pk).update(status=RunStatus.ERROR, error_code="reconciled", result="")
    requests_seen.clear()  # only what the model is asked from here on
    resumed = execute(services.resume_run(answered.run_id, actor=alice))
    assert (resumed.status, resumed.result) == (RunStatus.SUCCESS, "Emailed Jane and noted it.")
    assert requests_seen == [] and resumed.tools_executed == []
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 1


@db
def test_a_run_that_succeeded_or_is_in_flight_is_decided_without_reading_its_session(alice):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    succeeded = run_now(params=script_params(SAY_DONE), created_by=alice)
    running = make_run(status=RunStatus.RUNNING, created_by=alice, heartbeat_at=timezone.now())
    for run, code in ((succeeded, "run_succeeded"), (running, "run_in_flight")):
        with CaptureQueriesContext(connection) as queries:
            assert resume.decide_resume(run).code == code
        assert not [q["sql"] for q in queries.captured_queries if '"events"' in q["sql"]], code


# --- The API, and every refusal it can say -------------------------------------------------------


@pytest.fixture
def api(alice):
    return kit.api(alice)


def failed_after_email(alice, model_down) -> AgentRun:
    return run_now(params=script_params(*SCRIPT), created_by=alice)


@db
def test_the_api_resumes_and_shows_the_decision_and_the_chain(api, alice, model_down_at_second_call):
    original = failed_after_email(alice, model_down_at_second_call)
    decision = api.get(f"/api/runs/{original.run_id}/").json()["resume_decision"]
    assert (decision["allowed"], decision["status"], decision["code"], decision["preview"]) == (
        True, 202, "resumable", [])
    model_down_at_second_call()
    response = api.post(f"/api/runs/{original.run_id}/resume/")
    assert response.status_code == 202, response.json()
    body = response.json()
    assert body["resume_of"] == str(original.run_id) and body["session_id"] == original.session_id
    assert body["config"] == original.config and body["trigger"] == original.trigger
    execute(AgentRun.objects.get(pk=body["run_id"]))
    detail = api.get(f"/api/runs/{original.run_id}/").json()
    assert [r["run_id"] for r in detail["resumes"]] == [body["run_id"]]
    assert detail["resume_decision"]["code"] == "already_resumed"
    assert detail["resume_decision"]["successor_run_id"] == body["run_id"]
    assert api.post(f"/api/runs/{original.run_id}/resume/").json()["code"] == "already_resumed"
    resumed = api.get(f"/api/runs/{body['run_id']}/").json()
    assert resumed["resume_of"] == str(original.run_id) and resumed["status"] == "success"
    assert resumed["resume_decision"]["code"] == "run_succeeded"


def assert_refused(response, status: int, code: str) -> dict:
    body = response.json()
    assert (response.status_code, body["code"]) == (status, code), body
    assert body["detail"].endswith(".") and len(body["detail"]) > 40
    return body


@db
def test_every_refusal_code_through_the_api(api, alice, django_user_model, model_down_at_second_call):
    from django.contrib.auth.models import Permission

    running = make_run(status=RunStatus.RUNNING, created_by=alice, heartbeat_at=timezone.now())
    assert_refused(api.post(f"/api/runs/{running.run_id}/resume/"), 409, "run_in_flight")
    succeeded = make_run(status=RunStatus.SUCCESS, tools=[], created_by=alice)
    assert_refused(api.post(f"/api/runs/{succeeded.run_id}/resume/"), 409, "run_succeeded")

    replayed = make_run(tools=[], created_by=alice)
    services.replay_run(replayed.run_id, actor=alice)
    body = assert_refused(api.post(f"/api/runs/{replayed.run_id}/resume/"), 409, "already_replayed")
    assert body["successor_run_id"]

    changed = failed_after_email(alice, model_down_at_second_call)
    AgentRun.objects.filter(pk=changed.pk).update(agent_fingerprint="0" * 64)
    assert "Replay it instead" in assert_refused(api.post(f"/api/runs/{changed.run_id}/resume/"), 409,
                                                 "agent_changed")["detail"]

    purged = failed_after_email(alice, model_down_at_second_call)
    retention.purge_events(days=1, now=timezone.now() + timedelta(days=2))
    assert_refused(api.post(f"/api/runs/{purged.run_id}/resume/"), 410, "session_gone")

    in_doubt = run_now(params=script_params(dict(SEND_EMAIL, tool_fails="SMTP timeout"), SAY_DONE), created_by=alice)
    body = assert_refused(api.post(f"/api/runs/{in_doubt.run_id}/resume/"), 409, "calls_in_doubt")
    assert body["tools"] == ["send_email"] and body["calls"] == [in_doubt.tool_calls.get().call_id]
    assert "Settle it" in body["detail"]
    preview = api.get(f"/api/runs/{in_doubt.run_id}/").json()["resume_decision"]["preview"]
    assert preview[0]["answer"] == resume.IN_DOUBT

    # Seeing a run is not continuing it: another user needs runs.replay_agentrun.
    viewer = django_user_model.objects.create_user("vic", password="vic-pass-123")
    viewer.user_permissions.add(Permission.objects.get(codename="view_agentrun"))
    other = kit.api(viewer)
    assert_refused(other.post(f"/api/runs/{in_doubt.run_id}/resume/"), 403, "resume_not_permitted")
    assert AgentRun.objects.filter(resume_of__isnull=False).count() == 0  # no refusal wrote a row


@db
def test_a_workflow_run_is_refused_with_its_own_code(api, alice):
    run = make_run(tools=[], created_by=alice)
    AgentRun.objects.filter(pk=run.pk).update(config={**run.config, "workflow": {"name": "wf", "graph": {}}})
    assert_refused(api.post(f"/api/runs/{run.run_id}/resume/"), 409, "workflow_not_resumable")


@db
def test_a_call_in_doubt_settled_done_is_answered_from_the_settlement(alice, admin_user, requests_seen):
    original = run_now(params=script_params(dict(SEND_EMAIL, tool_fails="SMTP timeout"), SAY_DONE),
                       created_by=alice)
    call = original.tool_calls.get()
    decisions.settle_call(run_id=original.run_id, call_id=call.call_id, actor=admin_user, outcome="done",
                        note="The outbox shows the email to Jane.")
    preview = resume.decide_resume(original).answers
    assert [(a.kind, a.response["evidence"]) for a in preview] == [
        (resume.SETTLED_DONE, "The outbox shows the email to Jane.")]
    requests_seen.clear()  # only what the model is asked from here on
    resumed = execute(services.resume_run(original.run_id, actor=alice))
    assert resumed.status == RunStatus.SUCCESS, resumed.error_message
    assert resumed.tools_executed == [] and OutboxEmail.objects.count() == 1
    seen = [p.function_response.response for c in requests_seen[0].contents for p in c.parts if p.function_response]
    assert seen[0]["status"] == "done" and seen[0]["evidence"] == "The outbox shows the email to Jane."
    assert resumed.result == "Done."
    titles = [item["title"] for item in timeline.timeline_items(timeline.run_events(resumed))]
    assert titles == ["send_email answered by the resume", "support said"]
    # Continued, so the desk no longer waits for a decision on the original.
    assert not overview.awaiting_decision(AgentRun.objects.filter(pk=original.pk)).exists()


@db
def test_a_call_settled_not_done_is_called_again_by_the_model_under_a_fresh_id(alice, admin_user):
    original = run_now(params=script_params(dict(SEND_EMAIL, id="mail-1", tool_fails="SMTP refused"), SAY_DONE),
                       created_by=alice)
    OutboxEmail.objects.all().delete()  # what the person saw: nothing went out
    decisions.settle_call(run_id=original.run_id, call_id="mail-1", actor=admin_user, outcome="not_done",
                        note="The outbox is empty.")
    (answer,) = resume.decide_resume(original).answers
    assert answer.kind == resume.SETTLED_NOT_DONE and "did not happen" in answer.response["error"]
    resumed = execute(services.resume_run(original.run_id, actor=alice))
    assert resumed.status == RunStatus.SUCCESS, resumed.error_message
    (again,) = resumed.tool_calls.all()
    assert again.tool_name == "send_email" and again.call_id == f"mail-1~{resumed.run_id.hex[:8]}"
    assert again.status == "answered"  # played without its fault
    assert OutboxEmail.objects.count() == 1


@db
def test_a_resumed_run_can_itself_be_resumed_then_replayed_under_the_same_rules(alice, monkeypatch):
    script = [SEND_EMAIL, UPDATE_CRM, LOOKUP, {"say": "All done."}]
    original = ScriptedLlm.generate_content_async
    failing_at = {"calls": 1}

    async def down(self, llm_request, stream=False):
        if self.calls_made >= failing_at["calls"]:
            raise scripted.ScriptedModelError("The provider is down.")
        async for response in original(self, llm_request, stream):
            yield response

    monkeypatch.setattr(ScriptedLlm, "generate_content_async", down)
    first = run_now(params=script_params(*script), created_by=alice)
    second = execute(services.resume_run(first.run_id, actor=alice))
    assert (second.status, second.tools_executed) == (RunStatus.ERROR, ["update_crm"])
    failing_at["calls"] = 99
    third = execute(services.resume_run(second.run_id, actor=alice))
    assert (third.status, third.tools_executed, third.result) == (RunStatus.SUCCESS, ["lookup_customer"], "All done.")
    assert third.session_id == first.session_id
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 1
    # One successor per run: the middle one is continued, so it is neither resumed nor replayed again.
    assert resume.decide_resume(second).refusal.code == "already_resumed"
    # The last one succeeded; a replay of it follows the replay rules (force, reusing recorded effects).
    assert rules.decide(third, force=False).code == "run_succeeded"
    # Memory: the successful chain's conversation, each invocation under its own run.
    remembered = set(MemoryEntry.objects.values_list("run_id", flat=True))
    assert {first.run_id, third.run_id} <= remembered


@db
def test_the_intent_of_a_resume_is_its_originals(alice, model_down_at_second_call):
    original = failed_after_email(alice, model_down_at_second_call)
    resumed = services.resume_run(original.run_id, actor=alice)
    assert effects.intent_id(resumed) == effects.intent_id(original) == f"run:{original.run_id}"


@postgres_only
@db
def test_concurrent_resume_requests_create_one_resume(alice, model_down_at_second_call):
    original = failed_after_email(alice, model_down_at_second_call)
    barrier = threading.Barrier(4)
    outcomes: list[str] = []

    def request() -> None:
        barrier.wait()
        try:
            services.resume_run(original.run_id, actor=alice)
            outcomes.append("resumed")
        except Refusal as refusal:
            outcomes.append(refusal.code)
        finally:
            connection.close()

    threads = [threading.Thread(target=request) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["already_resumed"] * 3 + ["resumed"]
    assert AgentRun.objects.filter(resume_of=original).count() == 1


# --- The admin's Resume button -----------------------------------------------------------------------

CHANGELIST = "/admin/runs/agentrun/"


def button_form(html: str, button_id: str) -> dict:
    for url, body in re.findall(r'<form method="post" action="([^"]+)">(.*?)</form>', html, re.S):
        if f'id="{button_id}"' in body:
            return {"url": url, "fields": dict(re.findall(r'name="([^"]+)" value="([^"]*)"', body))}
    raise AssertionError(f"no form with the button {button_id}")


@db
def test_the_resume_button_confirms_with_the_preview_then_opens_the_resume(support_agent, admin_user):
    # sam's own run, whose script places a fault: that needs runs.place_tool_faults.
    support_agent.user_permissions.add(Permission.objects.get(codename="place_tool_faults"))
    support_agent = type(support_agent).objects.get(pk=support_agent.pk)
    original = run_now(params=script_params(dict(SEND_EMAIL, tool_fails="SMTP timeout"), SAY_DONE),
                       created_by=support_agent, owner_id=support_agent.username)
    call = original.tool_calls.get()
    client = login(support_agent)
    html = client.get(f"{CHANGELIST}{original.pk}/change/").content.decode()
    form = button_form(html, "resume-button")

    assert 'id="resume-decision"' in html and "Resume: refused (calls_in_doubt)." in html
    # In doubt: the page says so in the API's words, and offers nothing to confirm.
    refused = client.post(form["url"], form["fields"]).content.decode()
    assert "is in doubt" in refused and "Yes, resume" not in refused

    decisions.settle_call(run_id=original.run_id, call_id=call.call_id, actor=admin_user, outcome="done",
                        note="The outbox shows the email.")
    confirmation = client.post(form["url"], form["fields"]).content.decode()
    assert f'id="resume-preview-{call.call_id}"' in confirmation
    assert resume.SETTLED_DONE in confirmation and "The outbox shows the email." in confirmation
    assert AgentRun.objects.count() == 1

    response = client.post(form["url"], {**form["fields"], "post": "yes"}, follow=True)
    resumed = AgentRun.objects.get(resume_of=original)
    assert response.redirect_chain[-1][0] == f"{CHANGELIST}{resumed.pk}/change/"
    messages = [m.message for m in response.context["messages"]]
    assert messages == [f"support run {str(original.run_id)[:8]}: Resumed as run {str(resumed.run_id)[:8]} in the "
                        "same session."]
    page = response.content.decode()
    assert "resume of" in page.lower() and f">{str(original.run_id)[:8]}</a>" in page


@db
def test_the_resume_page_asks_the_apis_permission(run_viewer, alice):
    original = run_now(params=script_params(SEND_EMAIL, SAY_DONE), created_by=alice)
    AgentRun.objects.filter(pk=original.pk).update(status=RunStatus.ERROR)
    # A run of their own gets them the action (as for Replay); alice's run is still not theirs to resume.
    make_run(created_by=run_viewer, owner_id=run_viewer.username)
    client = Client()
    client.force_login(run_viewer)  # sees every run, did not start this one, may not replay others' runs
    data = {"action": "resume_selected", "_selected_action": [str(original.pk)]}
    assert client.post(CHANGELIST, data).status_code == 403
    response = client.post(CHANGELIST, {**data, "post": "yes"}, follow=True)
    assert [m.message for m in response.context["messages"]] == [
        f"support run {str(original.run_id)[:8]}: {ResumeNotPermitted().admin_detail}"]
    assert not AgentRun.objects.filter(resume_of=original).exists()


# --- Chat: a failed turn resumed inside its conversation ------------------------------------------


@db
def test_a_failed_chat_turn_resumes_in_its_conversation_and_the_next_turn_follows_it(alice, model_down_at_second_call, requests_seen):
    from runs.chat import turns

    first = turns.begin_turn(user=alice, agent_name="support", owner_id="alice", message="Email Jane.",
                             params=script_params(*SCRIPT))
    first = execute(first)
    assert first.status == RunStatus.ERROR
    model_down_at_second_call()

    # While the resume waits to run, the conversation is busy: no next turn slips in before it.
    resumed = services.resume_run(first.run_id, actor=alice)
    assert (resumed.conversation_id, resumed.session_id, resumed.trigger) == (
        first.conversation_id, first.session_id, "chat")
    with pytest.raises(turns.ConversationBusy):
        turns.begin_turn(user=alice, agent_name="support", owner_id="alice", message="Thanks!",
                         conversation_id=first.conversation_id, params=script_params({"say": "You're welcome."}))
    resumed = execute(resumed)
    assert resumed.status == RunStatus.SUCCESS and resumed.tools_executed == ["update_crm"]

    requests_seen.clear()  # only what the model is asked from here on
    second = execute(turns.begin_turn(
        user=alice, agent_name="support", owner_id="alice", message="Thanks!",
        conversation_id=first.conversation_id, params=script_params({"say": "You're welcome."})))
    assert (second.status, second.result, second.tools_executed) == (RunStatus.SUCCESS, "You're welcome.", [])
    said = [(content.role, part.text or (part.function_call and part.function_call.name)
             or (part.function_response and part.function_response.name))
            for content in requests_seen[0].contents for part in content.parts]
    # The whole conversation, in order: the first turn, its resume, then the new message.
    assert [text for _role, text in said if text] [-5:] == [
        "send_email", "update_crm", "update_crm", "Emailed Jane and noted it.", "Thanks!"]
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 1


@db
def test_a_chat_turn_the_conversation_went_on_after_is_refused(alice, model_down_at_second_call):
    from runs.chat import turns

    first = execute(turns.begin_turn(user=alice, agent_name="support", owner_id="alice", message="Email Jane.",
                                     params=script_params(*SCRIPT)))
    model_down_at_second_call()
    second = execute(turns.begin_turn(user=alice, agent_name="support", owner_id="alice", message="Hello?",
                                      conversation_id=first.conversation_id, params=script_params(SAY_DONE)))
    refusal = resume.decide_resume(first).refusal
    assert (refusal.code, refusal.context["later_run_id"]) == ("conversation_moved_on", str(second.run_id))


@db
def test_a_replay_waits_for_a_resume_in_flight_and_a_finished_resume_needs_force(alice, model_down_at_second_call):
    original = failed_after_email(alice, model_down_at_second_call)
    model_down_at_second_call()
    resumed = services.resume_run(original.run_id, actor=alice)
    decision = rules.decide(original, force=True)
    assert (decision.code, decision.refusal.context["resume_run_id"]) == ("resume_in_flight", str(resumed.run_id))
    execute(resumed)
    assert rules.decide(original, force=False).code == "already_resumed"
    assert rules.decide(original, force=True).allowed


@db
def test_resumes_are_throttled_with_replays(api, alice, settings):
    settings.THROTTLE_RATES = {**{scope: None for scope in settings.THROTTLE_RATES}, "runs.replay": "1/min"}
    first, second = make_run(created_by=alice, tools=[]), make_run(created_by=alice, tools=[])
    # The first is refused by the rules (its session is empty) and still counts; the second is throttled.
    assert api.post(f"/api/runs/{first.run_id}/resume/").json()["code"] == "session_gone"
    refused = api.post(f"/api/runs/{second.run_id}/resume/")
    assert (refused.status_code, refused.json()["code"]) == (429, "throttled")
    assert refused.has_header("Retry-After")


@db
def test_a_run_stopped_inside_a_sub_agent_resumes_in_that_agent(agents_dir, alice, model_down_at_second_call):
    from tests.helpers import package_source

    agents_dir(mailer=package_source("mailer"))
    params = {"scripts": {
        "mailer": [{"call": "transfer_to_agent", "args": {"agent_name": "notes"}}],
        "notes": [LOOKUP, {"say": "Jane is on the pro plan."}],
    }}
    original = run_now(agent_name="mailer", params=params, created_by=alice)
    assert original.status == RunStatus.ERROR and original.tools_executed == ["transfer_to_agent", "lookup_customer"]
    model_down_at_second_call()
    resumed = execute(services.resume_run(original.run_id, actor=alice))
    assert (resumed.status, resumed.result, resumed.tools_executed) == (RunStatus.SUCCESS, "Jane is on the pro plan.", [])
