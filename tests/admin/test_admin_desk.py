"""The admin support desk, driven through its URLs as logged-in support staff."""

from __future__ import annotations

import io
import re

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse

from runs.models.ledger import AgentRun, RunStatus
from runs.services import run as services
from tests.factories import ADMIN_HINT, API_HINT, TABLE, make_run, run_in_state
from tests.helpers import SEND_EMAIL, UPDATE_CRM, run_now, script_params
from tests.kit import login

# The desk's runs are executed for real first: the agent loop's ORM thread and ADK's engine read the test's commits.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_worker")]
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed

CHANGELIST = "/admin/runs/agentrun/"



@pytest.fixture
def sam(support_agent):
    return login(support_agent)


@pytest.fixture
def lee(support_lead):
    return login(support_lead)


def page(response) -> str:
    assert response.status_code == 200, response.status_code
    return response.content.decode()


def texts(response) -> list[tuple[str, str]]:
    """The messages shown on the page the request ended on (showing them uses them up)."""
    return [(m.level_tag, m.message) for m in response.context["messages"]]


def landed(response) -> str:
    return response.redirect_chain[-1][0] if response.redirect_chain else ""


def act(client, action: str, runs, **extra):
    data = {"action": action, "_selected_action": [str(r.pk) for r in runs], **extra}
    return client.post(CHANGELIST, data, follow=True)


def label(run) -> str:
    return f"support run {str(run.run_id)[:8]}"


# --- The list ---------------------------------------------------------------------------------------


def test_the_list_shows_what_support_needs(sam):
    failed = make_run(tools=["send_email", "update_crm"], error_code="tool_failed", error_message="CRM down")
    unknown = make_run(tools=None)
    make_run(tools=["lookup_customer", "send_email", "lookup_customer"])
    replay = make_run(status=RunStatus.QUEUED)
    AgentRun.objects.filter(pk=replay.pk).update(replay_of=failed)

    html = page(sam.get(CHANGELIST))
    for column in ("status", "agent", "trigger", "owner", "tools called", "created", "error",
                   "replays / resumes", "replay of", "replayed by"):
        assert column in html.lower()
    # Each tool's name on one line, the cell wrapping only between them.
    assert '<span class="nowrap">send_email</span>, <span class="nowrap">update_crm</span>' in html
    # each tool once, in first-call order
    assert '<span class="nowrap">lookup_customer ×2</span>, <span class="nowrap">send_email</span>' in html
    assert "unknown" in html
    assert f"{str(failed.run_id)[:8]} (error)" in html  # the replay's link back to its original
    assert reverse("admin:runs_agentrun_change", args=[replay.run_id]) in html  # the original's latest replay
    assert str(unknown.run_id)[:8] in html
    # A search never counts the whole table ("1 result (3 total)"), and filters offer no counts.
    searched = page(sam.get(CHANGELIST, {"q": str(unknown.run_id)}))
    assert "1 result" in searched and "Show all" in searched and "total)" not in searched
    assert "Show counts" not in searched


@pytest.mark.parametrize("value, expected", [("unknown", {"unknown"}), ("none", {"none"}), ("called", {"called"})])
def test_the_tools_filter(sam, value, expected):
    runs = {
        "unknown": make_run(tools=None),
        "none": make_run(tools=[]),
        "called": make_run(tools=["send_email"]),
    }
    html = page(sam.get(CHANGELIST, {"tools": value}))
    shown = {name for name, run in runs.items() if str(run.run_id)[:8] in html}
    assert shown == expected


def test_status_trigger_and_agent_filters(sam):
    ok = make_run(status=RunStatus.SUCCESS, tools=[])
    failed = make_run(status=RunStatus.ERROR, tools=[])
    AgentRun.objects.filter(pk=failed.pk).update(trigger="webhook")
    html = page(sam.get(CHANGELIST, {"status__exact": "success"}))
    assert str(ok.run_id)[:8] in html and str(failed.run_id)[:8] not in html
    html = page(sam.get(CHANGELIST, {"trigger__exact": "webhook"}))
    assert str(failed.run_id)[:8] in html and str(ok.run_id)[:8] not in html
    html = page(sam.get(CHANGELIST, {"agent": "support"}))
    assert str(failed.run_id)[:8] in html and str(ok.run_id)[:8] in html


@pytest.mark.parametrize("how", ["run_id", "owner", "error", "garbage"])
def test_search(sam, how):
    target = make_run(tools=[], error_code="rate_limited", error_message="The provider said 429 RESOURCE_EXHAUSTED")
    other = make_run(tools=[], error_message="something else")
    AgentRun.objects.filter(pk=target.pk).update(owner_id="jane.doe")
    term = {"run_id": str(target.run_id), "owner": "jane.doe", "error": "resource_exhausted",
            "garbage": "no-such-thing-%%"}[how]
    html = page(sam.get(CHANGELIST, {"q": term}))
    assert (str(target.run_id)[:8] in html) is (how != "garbage")
    assert str(other.run_id)[:8] not in html


def test_the_list_costs_the_same_queries_for_3_or_30_runs(sam):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            page(sam.get(CHANGELIST))
        return len(captured)

    for _ in range(3):
        replay = make_run(tools=[])
        AgentRun.objects.filter(pk=replay.pk).update(replay_of=make_run(tools=["send_email"]))
    few = queries()
    for _ in range(27):
        replay = make_run(tools=[])
        AgentRun.objects.filter(pk=replay.pk).update(replay_of=make_run(tools=["send_email"]))
    assert queries() == few


def test_nothing_can_be_added_changed_or_deleted(lee):
    run = make_run(tools=[])
    assert lee.get(f"{CHANGELIST}add/").status_code == 403
    html = page(lee.get(f"{CHANGELIST}{run.pk}/change/"))
    assert 'name="_save"' not in html
    assert lee.post(f"{CHANGELIST}{run.pk}/change/", {"status": "success"}).status_code == 403
    assert lee.get(f"{CHANGELIST}{run.pk}/delete/").status_code == 403
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.ERROR


def test_people_outside_support_are_kept_out(alice):
    run = make_run(tools=[], file=b"secret")
    client = login(alice)
    assert client.get(CHANGELIST).status_code == 302  # not staff: the admin login page
    assert client.get(f"{CHANGELIST}{run.pk}/input-file/").status_code == 302


# --- The run page -------------------------------------------------------------------------------------


@committed
def test_the_run_page_tells_the_story(lee, support_lead):
    run = run_now(
        params=script_params(SEND_EMAIL, UPDATE_CRM, {"fail": "error", "message": "backend down"}),
        file=io.BytesIO(b"invoice 42: 19.99 EUR"),
        file_name="invoice.txt",
    )
    replay = services.replay_run(run.run_id, actor=support_lead, force=True, reason="email bounced")
    html = page(lee.get(f"{CHANGELIST}{run.pk}/change/"))

    # Input, with a link to the stored copy, never its path.
    assert run.message in html
    download = reverse("admin:runs_agentrun_input_file", args=[run.run_id])
    assert f'href="{download}"' in html
    assert run.input_file not in html
    assert "run-inputs" not in html
    # Timeline: user message, each call with its arguments, each response, the error.
    timeline = html[html.index('id="timeline"'):]
    assert "User message" in timeline
    assert "called send_email" in timeline and "jane@example.com" in timeline
    assert "send_email answered" in timeline
    assert "called update_crm" in timeline and "C-1001" in timeline
    assert "backend down" in timeline
    # Journal
    assert "tool journal" in html.lower()
    # Replay chain: this run and its forced replay.
    chain = html[html.index('id="replay-chain"'):]
    assert str(replay.run_id)[:8] in chain and "forced by lee" in chain
    # What a replay would do now: its replay is in flight.
    decision = html[html.index('id="replay-decision"'):html.index('id="replay-decision"') + 2000]
    assert "replay_in_flight" in decision
    assert str(replay.run_id) in decision


def test_the_decision_on_the_run_page_speaks_admin(sam):
    run = make_run(tools=["send_email", "update_crm"])
    html = page(sam.get(f"{CHANGELIST}{run.pk}/change/"))
    assert "This run already called send_email, update_crm before failing: a replay would call them again." in html
    assert "Use “Force replay…” to run it again anyway." in html
    assert API_HINT not in html
    # The support agent may replay but not force: no force button.
    assert 'id="replay-button"' in html
    assert 'id="force-replay-button"' not in html


def test_the_stored_file_is_streamed_to_staff(sam):
    run = make_run(tools=[], file=b"invoice 42: 19.99 EUR")
    response = sam.get(f"{CHANGELIST}{run.pk}/input-file/")
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == b"invoice 42: 19.99 EUR"
    assert 'attachment; filename="invoice.txt"' in response["Content-Disposition"]

    from pathlib import Path

    Path(run.input_file).unlink()
    assert sam.get(f"{CHANGELIST}{run.pk}/input-file/").status_code == 404
    assert "gone from disk" in page(sam.get(f"{CHANGELIST}{run.pk}/change/"))


def test_a_row_pointing_outside_the_inputs_directory_is_never_served(sam, tmp_path):
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("not yours")
    run = make_run(tools=[], input_file=str(outside), input_file_name="elsewhere.txt", input_file_size=9)
    assert sam.get(f"{CHANGELIST}{run.pk}/input-file/").status_code == 404


# --- Actions: every row of the table -------------------------------------------------------------------


@pytest.mark.parametrize("state, code, status, force_code, force_status", TABLE)
def test_every_row_of_the_replay_table_through_the_admin(lee, state, code, status, force_code, force_status):
    original = run_in_state(state)
    from runs.rules import replay as rules

    expected = rules.decide(original, force=False).refusal
    response = act(lee, "replay_selected", [original])
    messages = texts(response)
    if code is None:
        replay = AgentRun.objects.get(replay_of=original, forced=False)
        assert landed(response) == reverse("admin:runs_agentrun_change", args=[replay.run_id])
        assert messages == [("success", f"{label(original)}: Replayed as run {str(replay.run_id)[:8]}.")]
        replay.delete()
    else:
        assert expected.code == code
        assert messages == [("warning", f"{label(original)}: {expected.admin_detail}")]
        assert API_HINT not in expected.admin_detail
        if code in {"run_succeeded", "already_replayed", "tools_called", "tools_unknown"}:
            assert expected.admin_detail.endswith(ADMIN_HINT)
        assert not AgentRun.objects.filter(replay_of=original).exclude(pk=getattr(original, "replay_id", None)).exists()

    response = act(lee, "force_replay_selected", [original], post="yes", reason="Customer asked again")
    messages = texts(response)
    if force_code is None:
        replay = AgentRun.objects.filter(replay_of=original).exclude(pk=getattr(original, "replay_id", None)).get()
        assert replay.forced is (code is not None)
        verb = "Force-replayed" if replay.forced else "Replayed"
        assert messages == [("success", f"{label(original)}: {verb} as run {str(replay.run_id)[:8]}.")]
    else:
        forced_refusal = rules.decide(original, force=True).refusal
        assert forced_refusal.code == force_code
        assert messages == [("warning", f"{label(original)}: {forced_refusal.admin_detail}")]


def test_replay_reports_each_run(lee):
    ok = make_run(tools=[])
    called = make_run(tools=["send_email"])
    unknown = make_run(tools=None)
    response = act(lee, "replay_selected", [ok, called, unknown])
    assert landed(response) == CHANGELIST
    messages = texts(response)
    assert len(messages) == 3
    assert ("warning", f"{label(called)}: This run already called send_email before failing: a replay would call "
                       f"it again. {ADMIN_HINT}") in messages
    assert ("warning", f"{label(unknown)}: It is unknown whether this run called any tool before failing, so a "
                       f"replay could repeat a side effect. {ADMIN_HINT}") in messages
    assert AgentRun.objects.filter(replay_of=ok).count() == 1
    assert AgentRun.objects.count() == 4


@committed
def test_force_replay_confirmation_lists_what_each_run_called_and_needs_a_reason(lee, support_lead):
    failed = run_now(params=script_params(SEND_EMAIL, UPDATE_CRM, {"fail": "error", "message": "lost"}))
    unknown = make_run(tools=None)
    running = make_run(status=RunStatus.RUNNING)

    html = page(act(lee, "force_replay_selected", [failed, unknown, running]))
    assert "Are you sure you want to force a replay" in html
    assert "Already called: send_email, update_crm" in html
    assert "Already called: unknown" in html
    assert "send_email({&quot;to&quot;: &quot;jane@example.com&quot;" in html
    assert "Will not be replayed: This run is still running" in html
    assert 'name="post" value="yes"' in html
    assert html.count('name="_selected_action"') == 3
    assert 'name="reason"' in html
    assert AgentRun.objects.count() == 3

    # Confirming without a reason shows the page again with the problem, and does nothing.
    html = page(act(lee, "force_replay_selected", [failed, unknown], post="yes", reason="  "))
    assert "Give a reason" in html
    assert AgentRun.objects.count() == 3

    response = act(lee, "force_replay_selected", [failed, unknown, running], post="yes", reason="Bounced email")
    assert landed(response) == CHANGELIST
    replays = AgentRun.objects.filter(replay_of__in=[failed, unknown])
    assert replays.count() == 2
    assert all(r.forced and r.forced_by == support_lead and r.force_reason == "Bounced email" for r in replays)
    assert LogEntry.objects.filter(object_id__in=[str(r.pk) for r in replays], user=support_lead).count() == 2
    assert ("warning", f"{label(running)}: This run is still running: a replay now could do its work twice. "
                       "Cancel it or wait for it to finish.") in texts(response)


def test_force_replay_is_not_offered_without_the_permission(sam):
    run = make_run(tools=["send_email"])
    html = page(sam.get(CHANGELIST))
    assert 'value="replay_selected"' in html
    assert 'value="force_replay_selected"' not in html
    act(sam, "force_replay_selected", [run], post="yes", reason="sneaky")
    assert AgentRun.objects.count() == 1


def test_cancel_action(sam):
    queued = make_run(status=RunStatus.QUEUED)
    running = make_run(status=RunStatus.RUNNING)
    done = make_run(status=RunStatus.SUCCESS, tools=[])
    response = act(sam, "cancel_selected", [queued, running, done])
    messages = texts(response)
    assert ("success", f"{label(queued)}: cancelled; it will not start.") in messages
    assert any(m.startswith(f"{label(running)}: cancellation requested") for _, m in messages)
    assert ("warning", f"{label(done)}: This run already finished as success: there is nothing left to cancel.") in messages
    assert AgentRun.objects.get(pk=queued.pk).status == RunStatus.CANCELLED
    assert AgentRun.objects.get(pk=running.pk).cancel_requested_at is not None


# --- Buttons on the run page ---------------------------------------------------------------------------


def _button_form(html: str, button_id: str) -> dict:
    for url, body in re.findall(r'<form method="post" action="([^"]+)">(.*?)</form>', html, re.S):
        if f'id="{button_id}"' in body:
            return {"url": url, "fields": dict(re.findall(r'name="([^"]+)" value="([^"]*)"', body))}
    raise AssertionError(f"no form with the button {button_id}")


def test_the_replay_button_replays_and_opens_the_new_run(lee):
    run = make_run(tools=[])
    html = page(lee.get(f"{CHANGELIST}{run.pk}/change/"))
    form = _button_form(html, "replay-button")
    response = lee.post(form["url"], form["fields"], follow=True)
    replay = AgentRun.objects.get(replay_of=run)
    assert landed(response) == reverse("admin:runs_agentrun_change", args=[replay.run_id])
    assert texts(response) == [("success", f"{label(run)}: Replayed as run {str(replay.run_id)[:8]}.")]


def test_a_refused_replay_button_returns_to_the_run_with_the_reason(lee):
    run = make_run(tools=["send_email"])
    html = page(lee.get(f"{CHANGELIST}{run.pk}/change/"))
    form = _button_form(html, "replay-button")
    response = lee.post(form["url"], form["fields"], follow=True)
    assert landed(response) == f"{CHANGELIST}{run.pk}/change/"
    assert texts(response)[0][0] == "warning"
    assert AgentRun.objects.count() == 1


def test_the_force_replay_button_confirms_then_opens_the_new_run(lee):
    run = make_run(tools=["send_email"])
    html = page(lee.get(f"{CHANGELIST}{run.pk}/change/"))
    form = _button_form(html, "force-replay-button")
    confirmation = page(lee.post(form["url"], form["fields"]))
    assert "Already called: send_email" in confirmation
    assert AgentRun.objects.count() == 1
    response = lee.post(form["url"], {**form["fields"], "post": "yes", "reason": "resend"}, follow=True)
    replay = AgentRun.objects.get(replay_of=run)
    assert replay.forced
    assert landed(response) == reverse("admin:runs_agentrun_change", args=[replay.run_id])
    assert "Forced replay of" not in page(response)  # the new run's page, not a log dump


def test_the_list_never_counts_past_its_cap(sam, monkeypatch):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from config.lib import admin as desk

    monkeypatch.setattr(desk.CappedCountPaginator, "cap", 5)
    for _ in range(7):
        make_run(tools=[])
    with CaptureQueriesContext(connection) as captured:
        html = page(sam.get(CHANGELIST))
    assert "5+ agent runs" in html
    counts = [q["sql"] for q in captured.captured_queries if "COUNT(" in q["sql"].upper()]
    assert counts and all("LIMIT 6" in sql.upper() for sql in counts), counts
