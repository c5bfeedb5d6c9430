"""Calls in doubt, settled by a person: the API, the run page, and what the replay rules then say."""

from __future__ import annotations

import json
import signal
import textwrap
from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.utils import timezone

from agents.models import OutboxEmail
from runs.execution import executor
from runs.ledger import reconcile
from runs.models.effects import EffectStatus, ToolEffect
from runs.models.ledger import AgentRun, RunStatus
from runs.refusals import CallsInDoubt, NoteRequired, NotInDoubt, SettleNotPermitted, ToolsCalled
from runs.rules import replay as rules
from runs.services import run as services
from runs.services.decisions import settle_call
from tests.helpers import SAY_DONE, SEND_EMAIL, run_now, run_python, script_params
from tests.kit import api, login

# Runs execute on the agent loop, and a worker killed in a child process leaves the calls to settle.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def settler(django_user_model):
    """Support staff who may settle calls in doubt (and see every run), but not force replays."""
    user = django_user_model.objects.create_user("sue", password="sue-pass-123", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=["view_agentrun", "settle_toolcall"]))
    return user


def killed_inside_the_tool(crash: str, *, created_by=None) -> AgentRun:
    """A real worker process SIGKILLed inside send_email, then reconciled as the periodic job would."""
    script = json.dumps([dict(SEND_EMAIL, crash=crash), SAY_DONE])
    code = textwrap.dedent(f"""
        import json
        from runs.execution import executor
        from runs.services import run as services
        run = services.start_run(agent_name="support", message="Email Jane.", owner_id="jane",
                                 params={{"script": json.loads({script!r})}}, enqueue=False)
        print(run.run_id, flush=True)
        executor.execute(run.run_id)
    """)
    child = run_python(code)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    run = AgentRun.objects.get(pk=child.stdout.split()[0])
    if created_by is not None:
        AgentRun.objects.filter(pk=run.pk).update(created_by=created_by)
    later = timezone.now() + timedelta(seconds=settings.RUN_STALE_AFTER_SECONDS + 1)
    reconcile.sweep(now=later)
    run.refresh_from_db()
    assert (run.status, run.error_code) == (RunStatus.ERROR, "reconciled")
    return run


def execute_replay(replay: AgentRun) -> AgentRun:
    """Run a replay in this process with the original's script minus its crash (it would kill the test)."""
    AgentRun.objects.filter(pk=replay.pk).update(config={**replay.config, "params": script_params(SEND_EMAIL, SAY_DONE)})
    executor.execute(replay.run_id)
    replay.refresh_from_db()
    return replay


def url(run: AgentRun, call_id: str) -> str:
    return f"/api/runs/{run.run_id}/calls/{call_id}/settle/"


# --- The API ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_settling_needs_the_permission_and_a_note(support_lead, settler):
    run = killed_inside_the_tool("after_effect")
    call = run.tool_calls.get()
    assert call.in_doubt

    # Forcing replays is not settling calls.
    denied = api(support_lead).post(url(run, call.call_id), {"outcome": "done", "note": "saw it"}, format="json")
    assert denied.status_code == 403 and denied.json()["code"] == "settle_not_permitted"
    no_note = api(settler).post(url(run, call.call_id), {"outcome": "done", "note": "  "}, format="json")
    assert no_note.status_code == 400 and no_note.json()["code"] == "note_required"
    bad = api(settler).post(url(run, call.call_id), {"outcome": "maybe", "note": "hm"}, format="json")
    assert bad.status_code == 400
    missing = api(settler).post(url(run, call.call_id), {"outcome": "done"}, format="json")
    assert missing.status_code == 400
    call.refresh_from_db()
    assert call.settled_outcome == "" and call.in_doubt


@pytest.mark.slow
def test_settled_done_is_recorded_and_a_forced_replay_reuses_it(settler, support_lead):
    run = killed_inside_the_tool("after_effect")
    assert OutboxEmail.objects.count() == 1
    before = AgentRun.objects.filter(pk=run.pk).values().get()
    call = run.tool_calls.get()
    record = ToolEffect.objects.get()
    assert record.status == EffectStatus.STARTED  # written before the tool acted; never finished

    # Until a person settles it, the replay is refused, and a forced one does not send again.
    refusal = rules.decide(run, force=False).refusal
    assert isinstance(refusal, CallsInDoubt) and refusal.context["calls"] == [call.call_id]
    first_try = execute_replay(services.replay_run(run.run_id, actor=support_lead, force=True, reason="try"))
    assert first_try.error_code == "effect_in_doubt" and OutboxEmail.objects.count() == 1

    response = api(settler).post(
        url(run, call.call_id), {"outcome": "done", "note": "The outbox shows the email to Jane."}, format="json"
    )
    assert response.status_code == 200, response.json()
    body = response.json()
    assert (body["settled_outcome"], body["settled_by"], body["in_doubt"]) == ("done", "sue", False)
    assert body["settle_note"] == "The outbox shows the email to Jane." and body["settled_at"]
    assert body["status"] == "called"  # the journal's evidence stays as it was
    assert AgentRun.objects.filter(pk=run.pk).values().get() == before  # the run's outcome is untouched
    record.refresh_from_db()
    assert record.status == EffectStatus.DONE
    assert LogEntry.objects.filter(object_id=str(run.run_id), change_message__contains="as done").exists()

    # The rules read the settlement: a call that acted, so a replay needs force; forced, it reuses it.
    assert isinstance(rules.decide(run, force=False).refusal, ToolsCalled)
    again = execute_replay(services.replay_run(run.run_id, actor=support_lead, force=True, reason="finish it"))
    assert again.status == RunStatus.SUCCESS
    assert again.tool_calls.get().status == "deduplicated"
    assert OutboxEmail.objects.count() == 1

    # Settling twice is refused: it is no longer in doubt.
    twice = api(settler).post(url(run, call.call_id), {"outcome": "not_done", "note": "oops"}, format="json")
    assert twice.status_code == 409 and twice.json()["code"] == "not_in_doubt"
    assert "sue already settled it as done" in twice.json()["detail"]


@pytest.mark.slow
def test_settled_not_done_lets_the_replay_run_the_call(settler, support_lead):
    run = killed_inside_the_tool("before_effect")
    assert OutboxEmail.objects.count() == 0
    call = run.tool_calls.get()
    settled = settle_call(run_id=run.run_id, call_id=call.call_id, actor=settler, outcome="not_done",
                          note="Nothing in the outbox; the worker died before sending.")
    assert settled.settled_outcome == "not_done"
    assert ToolEffect.objects.get().status == EffectStatus.FAILED
    # Known not to have acted: the only call that acts is settled, so a replay needs no force.
    assert rules.decide(run, force=False).allowed
    replay = execute_replay(services.replay_run(run.run_id, actor=support_lead))
    assert replay.status == RunStatus.SUCCESS
    assert OutboxEmail.objects.count() == 1
    assert ToolEffect.objects.get().first_run_id == replay.run_id


def test_a_call_that_is_not_in_doubt_is_409_and_an_unseen_run_is_404(settler, alice, django_user_model):
    answered = run_now(params=script_params(SEND_EMAIL, {"fail": "error", "message": "lost"}), created_by=alice)
    call = answered.tool_calls.get()
    response = api(settler).post(url(answered, call.call_id), {"outcome": "done", "note": "sure"}, format="json")
    assert response.status_code == 409 and response.json()["code"] == "not_in_doubt"
    assert "it is answered" in response.json()["detail"]

    unknown_call = api(settler).post(url(answered, "call-nope"), {"outcome": "done", "note": "x"}, format="json")
    assert unknown_call.status_code == 404

    # Someone holding the permission who may not see the run: 404, as for any run they cannot see.
    outsider = django_user_model.objects.create_user("oz", password="oz-pass-123")
    outsider.user_permissions.add(Permission.objects.get(codename="settle_toolcall"))
    hidden = api(outsider).post(url(answered, call.call_id), {"outcome": "done", "note": "x"}, format="json")
    assert hidden.status_code == 404

    with pytest.raises(SettleNotPermitted):
        settle_call(run_id=answered.run_id, call_id=call.call_id, actor=alice, outcome="done", note="x")
    with pytest.raises(NoteRequired):
        settle_call(run_id=answered.run_id, call_id=call.call_id, actor=settler, outcome="done", note="")
    with pytest.raises(NotInDoubt):
        settle_call(run_id=answered.run_id, call_id=call.call_id, actor=settler, outcome="done", note="x")


def test_a_tool_that_raised_after_starting_its_effect_can_be_settled(settler):
    run = run_now(params=script_params(dict(SEND_EMAIL, tool_fails="connection reset after DATA")))
    call = run.tool_calls.get()
    assert call.status == "failed"  # it answered with an error; its effect record says it never finished
    assert isinstance(rules.decide(run, force=False).refusal, CallsInDoubt)
    settle_call(run_id=run.run_id, call_id=call.call_id, actor=settler, outcome="done", note="Jane got it.")
    assert ToolEffect.objects.get().status == EffectStatus.DONE
    assert rules.describe_now(run)["preview"][0]["reuse"] == "served from record"


# --- The run page ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_run_page_settles_a_call_in_doubt_for_those_allowed(settler, support_agent):
    run = killed_inside_the_tool("after_effect")
    call = run.tool_calls.get()
    page_url = f"/admin/runs/agentrun/{run.run_id}/change/"
    settle_url = f"/admin/runs/agentrun/{run.run_id}/calls/{call.call_id}/settle/"

    viewer = login(support_agent)
    html = viewer.get(page_url).content.decode()
    assert f'id="doubt-{call.call_id}"' in html
    assert "Settle this call" not in html
    assert "calls_in_doubt" in html and "is in doubt" in html
    # A crafted post by someone without the permission gets the refusal, and changes nothing.
    refused = viewer.post(settle_url, {"outcome": "done", "note": "x"}, follow=True)
    assert any("runs.settle_toolcall" in m.message for m in refused.context["messages"])
    call.refresh_from_db()
    assert call.settled_outcome == ""

    client = login(settler)
    html = client.get(page_url).content.decode()
    assert "Settle this call" in html and 'name="outcome" value="not_done"' in html
    no_note = client.post(settle_url, {"outcome": "done", "note": ""}, follow=True)
    assert any("needs a note" in m.message for m in no_note.context["messages"])
    done = client.post(settle_url, {"outcome": "done", "note": "Outbox row 1 is the email."}, follow=True)
    assert any("settled as done: it acted" in m.message for m in done.context["messages"])
    html = done.content.decode()
    assert f'id="settled-{call.call_id}"' in html and "Outbox row 1 is the email." in html
    assert "Settle this call" not in html
    assert client.get(settle_url).status_code == 405


@pytest.mark.slow
def test_a_key_settled_not_done_is_taken_over_even_with_other_stable_fields(settler, support_lead):
    run = killed_inside_the_tool("before_effect")
    call = run.tool_calls.get()
    settle_call(run_id=run.run_id, call_id=call.call_id, actor=settler, outcome="not_done", note="Outbox is empty.")
    replay = services.replay_run(run.run_id, actor=support_lead)
    other_subject = {"call": "send_email", "args": {**SEND_EMAIL["args"], "subject": "About your refund"}}
    AgentRun.objects.filter(pk=replay.pk).update(config={**replay.config, "params": script_params(other_subject, SAY_DONE)})
    executor.execute(replay.run_id)
    replay.refresh_from_db()
    # Nothing was sent under the old subject, so the new one is not a conflict: the email goes out once.
    assert replay.status == RunStatus.SUCCESS and replay.tool_calls.get().status == "answered"
    assert OutboxEmail.objects.get().subject == "About your refund"
    record = ToolEffect.objects.get()
    assert (record.status, record.first_run_id, record.stable_fields) == (
        EffectStatus.DONE, replay.run_id, {"subject": "about your refund"})
