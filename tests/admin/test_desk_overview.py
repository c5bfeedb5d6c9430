"""The desk's first page: its counts against a ledger seeded in every state, its links, its rights."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.utils import timezone

from runs.ledger.reconcile import RECONCILED
from runs.models.inbox import EventStatus, WebhookEvent, WebhookSource
from runs.models.ledger import AgentRun, Recovery, RunStatus, ToolCall, ToolCallStatus
from runs.models.schedules import FiringOutcome, RunSchedule, ScheduleFiring
from runs.rules import overview, replay
from tests.factories import make_run, run_in_state
from tests.helpers import UPDATE_CRM, run_now, script_params
from tests.kit import api, login

pytestmark = pytest.mark.django_db

DESK = "/admin/desk/"
RUNS = "/admin/runs/agentrun/"


def tile_count(html: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}" href="([^"]+)">\s*<span class="count">([^<]+)</span>', html)
    assert found, f"no tile {element_id}"
    return found.group(2).strip()


def tile_link(html: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}" href="([^"]+)"', html)
    assert found, f"no tile {element_id}"
    return found.group(1).replace("&amp;", "&")


def listed_ids(client: Client, url: str) -> set[str]:
    response = client.get(url)
    assert response.status_code == 200
    return {str(run.pk) for run in response.context["cl"].result_list}


def add_call(run: AgentRun, *, status: str, seq: int = 1) -> ToolCall:
    return ToolCall.objects.create(run=run, seq=seq, call_id=f"c-{run.pk}-{seq}", tool_name="send_email",
                                   args={}, status=status)


@pytest.fixture
def ledger(django_user_model):
    """One or more runs in every state the desk counts, and some it must not count."""
    now = timezone.now()
    seeded = {
        "tools_called": [run_in_state("error_tools"), make_run(status=RunStatus.CANCELLED, tools=["update_crm"])],
        "tools_unknown": [run_in_state("error_unknown")],
        # Not awaiting a decision: replayable, replay in flight, replayed successfully, succeeded.
        "replayable": [run_in_state("error_no_tools"), run_in_state("cancelled_no_tools")],
        "replay_in_flight": run_in_state("replay_in_flight"),
        "already_replayed": run_in_state("already_replayed"),
        "success": run_in_state("success"),
        "queued": run_in_state("queued"),
        "running": run_in_state("running"),
    }
    # A failed replay does not settle its original: both await a decision.
    original = make_run(tools=None)
    failed_replay = make_run(tools=["send_email"])
    AgentRun.objects.filter(pk=failed_replay.pk).update(replay_of=original)
    seeded["tools_unknown"].append(original)
    seeded["tools_called"].append(failed_replay)

    old = now - timedelta(hours=30)
    AgentRun.objects.filter(pk=seeded["queued"].pk).update(created_at=old)
    seeded["reconciled"] = make_run(tools=None, error_code=RECONCILED, finished_at=now - timedelta(hours=2))
    seeded["tools_unknown"].append(seeded["reconciled"])
    long_ago = make_run(tools=[], error_code=RECONCILED, finished_at=now - timedelta(days=3))
    seeded["replayable"].append(long_ago)

    # Calls in doubt: `called` in a settled run; a `called` call of a running run is not in doubt.
    # A run with an unanswered call awaits a decision on that call (calls_in_doubt), not tools_called.
    seeded["calls_in_doubt"] = [run_in_state("error_tools")]
    add_call(seeded["calls_in_doubt"][0], status=ToolCallStatus.CALLED)
    add_call(seeded["calls_in_doubt"][0], status=ToolCallStatus.CALLED, seq=2)
    add_call(seeded["reconciled"], status=ToolCallStatus.CALLED)
    add_call(seeded["running"], status=ToolCallStatus.CALLED)
    add_call(seeded["success"], status=ToolCallStatus.ANSWERED)

    source = WebhookSource.objects.create(slug="crm", name="CRM", agent_name="support", owner_id="jane",
                                          secret="s3cret", message_id_header="X-Message-Id")
    for index, status in enumerate([EventStatus.NEEDS_REVIEW, EventStatus.NEEDS_REVIEW, EventStatus.DEAD,
                                    EventStatus.DONE]):
        WebhookEvent.objects.create(source=source, external_id=f"m-{index}", payload={}, status=status)

    schedule = RunSchedule.objects.create(name="nightly", agent_name="support", message="Check refunds.",
                                          owner_id="jane", interval_minutes=60)
    quiet = RunSchedule.objects.create(name="weekly", agent_name="support", message="Summarise.",
                                       owner_id="jane", interval_minutes=60 * 24 * 7)
    ScheduleFiring.objects.create(schedule=schedule, slot=now - timedelta(hours=1), fired_at=now - timedelta(hours=1),
                                  outcome=FiringOutcome.SKIPPED, blocking_run=seeded["running"])
    ScheduleFiring.objects.create(schedule=schedule, slot=now - timedelta(hours=2), fired_at=now - timedelta(hours=2),
                                  outcome=FiringOutcome.SKIPPED)
    ScheduleFiring.objects.create(schedule=quiet, slot=now - timedelta(days=2), fired_at=now - timedelta(days=2),
                                  outcome=FiringOutcome.SKIPPED)
    ScheduleFiring.objects.create(schedule=quiet, slot=now - timedelta(hours=3), fired_at=now - timedelta(hours=3),
                                  outcome=FiringOutcome.STARTED)
    seeded["skipping_schedule"] = schedule
    return seeded


def ids(runs) -> set[str]:
    return {str(run.pk) for run in runs}


def test_the_counts_match_the_seeded_ledger(ledger):
    data = overview.build_overview()
    assert data.awaiting["calls_in_doubt"].value == len(ledger["calls_in_doubt"]) == 1
    assert data.awaiting["tools_called"].value == len(ledger["tools_called"]) == 3
    assert data.awaiting["tools_unknown"].value == len(ledger["tools_unknown"]) == 3
    assert data.calls_in_doubt.value == 3
    assert data.reconciled_24h.value == 1
    assert data.in_flight.count.value == 3  # queued, running, and the replay in flight
    assert data.in_flight.oldest.pk == ledger["queued"].pk
    assert {status: count.value for status, count in data.webhook_events.items()} == {"needs_review": 2, "dead": 1}
    assert data.skipped_firings_24h.value == 2
    assert len(data.hourly) == 24 and len(data.daily) == 7
    assert sum(bucket.total for bucket in data.daily) == AgentRun.objects.filter(
        created_at__gte=data.daily[0].start).count()
    assert sum(bucket.counts.get("error", 0) for bucket in data.hourly) >= 6


def test_each_awaiting_set_is_what_replay_decide_refuses_without_force(ledger):
    """The set-based rule agrees with `runs.rules.replay.decide`, run by run, over the whole ledger."""
    for run in AgentRun.objects.all():
        code = replay.decide(run, force=False).code
        assert (code == "calls_in_doubt") == overview.awaiting_calls_in_doubt(AgentRun.objects.filter(pk=run.pk)).exists()
        assert (code == "tools_called") == overview.awaiting_tools_called(AgentRun.objects.filter(pk=run.pk)).exists()
        assert (code == "tools_unknown") == overview.awaiting_tools_unknown(AgentRun.objects.filter(pk=run.pk)).exists()


def test_the_page_shows_the_counts_and_each_link_lands_on_exactly_its_rows(ledger, admin_user):
    client = login(admin_user)
    html = client.get(DESK).content.decode()
    assert tile_count(html, "awaiting-tools-called") == "3"
    assert tile_count(html, "awaiting-tools-unknown") == "3"
    assert tile_count(html, "calls-in-doubt") == "3"
    assert tile_count(html, "reconciled-24h") == "1"
    assert tile_count(html, "in-flight") == "3"
    assert tile_count(html, "events-needs-review") == "2"
    assert tile_count(html, "events-dead") == "1"
    assert tile_count(html, "schedules-skipped") == "2"
    assert str(ledger["queued"].pk)[:8] in html.split('id="oldest-in-flight"')[1]
    assert html.count("<svg class=\"desk-chart\"") == 2 and "<rect" in html

    assert listed_ids(client, tile_link(html, "awaiting-tools-called")) == ids(ledger["tools_called"])
    assert listed_ids(client, tile_link(html, "awaiting-tools-unknown")) == ids(ledger["tools_unknown"])
    assert tile_count(html, "awaiting-calls-in-doubt") == "1"
    assert listed_ids(client, tile_link(html, "awaiting-calls-in-doubt")) == ids(ledger["calls_in_doubt"])
    assert listed_ids(client, tile_link(html, "calls-in-doubt")) == ids([ledger["calls_in_doubt"][0], ledger["reconciled"]])
    assert listed_ids(client, tile_link(html, "reconciled-24h")) == ids([ledger["reconciled"]])
    in_flight = {str(pk) for pk in AgentRun.objects.filter(status__in=["queued", "running"]).values_list("pk", flat=True)}
    assert listed_ids(client, tile_link(html, "in-flight")) == in_flight

    events = client.get(tile_link(html, "events-needs-review"))
    assert {event.status for event in events.context["cl"].result_list} == {"needs_review"}
    assert len(events.context["cl"].result_list) == 2
    schedules = client.get(tile_link(html, "schedules-skipped"))
    assert [schedule.pk for schedule in schedules.context["cl"].result_list] == [ledger["skipping_schedule"].pk]


def test_the_admin_index_links_to_the_desk(admin_user, support_agent, django_user_model):
    assert 'href="/admin/desk/"' in login(admin_user).get("/admin/").content.decode()
    assert 'href="/admin/desk/"' in login(support_agent).get("/admin/").content.decode()
    inbox_only = django_user_model.objects.create_user("ina", password="x", is_staff=True)
    inbox_only.user_permissions.add(Permission.objects.get(codename="view_webhookevent"))
    assert "/admin/desk/" not in login(inbox_only).get("/admin/").content.decode()


def test_without_view_rights_on_runs_the_desk_shows_nothing(ledger, django_user_model):
    inbox_only = django_user_model.objects.create_user("ina", password="x", is_staff=True)
    inbox_only.user_permissions.add(Permission.objects.get(codename="view_webhookevent"))
    response = login(inbox_only).get(DESK)
    assert response.status_code == 403
    assert b"awaiting" not in response.content

    not_staff = django_user_model.objects.create_user("nat", password="x")
    not_staff.user_permissions.add(Permission.objects.get(codename="view_agentrun"))
    response = login(not_staff).get(DESK)
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")
    assert Client().get(DESK).status_code == 302


def test_support_staff_see_runs_but_not_the_inbox_or_schedules_they_may_not_view(ledger, support_agent):
    html = login(support_agent).get(DESK).content.decode()
    assert tile_count(html, "awaiting-tools-called") == "3"
    assert 'id="events-needs-review"' not in html and 'id="schedules-skipped"' not in html


def test_counts_are_capped(ledger):
    count = overview.capped_count(AgentRun.objects.all(), cap=2)
    assert (count.value, count.capped, str(count)) == (2, True, "2+")
    assert str(overview.capped_count(AgentRun.objects.filter(pk=ledger["success"].pk), cap=2)) == "1"
    assert (str(overview.CappedCount(overview.CAP, True)), str(overview.CappedCount(2380, False))) == ("10,000+", "2,380")


def test_several_counts_in_one_statement_are_each_capped_on_their_own(ledger, django_assert_num_queries):
    runs = AgentRun.objects.all()
    one = runs.filter(pk=ledger["success"].pk)
    with django_assert_num_queries(1 if connection.vendor != "postgresql" else 4):
        counts = overview.capped_counts({"all": runs, "one": one, "none": runs.none(), "waiting": overview.waiting(runs)},
                                        cap=2)
    assert {name: str(count) for name, count in counts.items()} == {"all": "2+", "one": "1", "none": "0",
                                                                    "waiting": "0"}
    assert counts["all"] == overview.capped_count(runs, cap=2) and counts["one"] == overview.capped_count(one, cap=2)


def test_the_page_runs_a_bounded_number_of_queries(ledger, admin_user, django_assert_max_num_queries):
    client = login(admin_user)
    client.get(DESK)  # warm the session and content types
    # Every tile's count is one statement (on PostgreSQL inside its own transaction, to turn JIT
    # off: four with SET LOCAL); then the chart, the two oldest in flight, the oldest open call,
    # and the session and user.
    with django_assert_max_num_queries(11):
        response = client.get(DESK)
    assert response.status_code == 200
    # More rows do not mean more queries.
    for _ in range(5):
        make_run(tools=["send_email"])
    with django_assert_max_num_queries(11):
        assert client.get(DESK).status_code == 200


def test_the_chart_buckets_runs_by_hour_and_outcome():
    now = timezone.now().replace(minute=30)
    make_run(status=RunStatus.SUCCESS, tools=[], created_at=now - timedelta(hours=1))
    make_run(status=RunStatus.ERROR, tools=[], created_at=now - timedelta(hours=1))
    make_run(status=RunStatus.ERROR, tools=[], created_at=now - timedelta(days=8))
    hourly = overview.runs_per_hour(now=now)
    assert len(hourly) == 24 * 7
    previous_hour = hourly[-2]
    assert previous_hour.counts == {"success": 1, "error": 1}
    assert previous_hour.start == (now - timedelta(hours=1)).replace(minute=0, second=0, microsecond=0)
    assert sum(bucket.total for bucket in hourly) == 2  # the eight-day-old run is outside


def test_the_live_fragment_follows_the_run_and_says_when_it_has_settled(support_agent, django_user_model):
    run = make_run(status=RunStatus.RUNNING, tools=None, heartbeat_at=timezone.now(), worker="w-1:9")
    add_call(run, status=ToolCallStatus.CALLED)
    client = login(support_agent)
    page = client.get(f"{RUNS}{run.pk}/change/").content.decode()
    assert 'id="run-live"' in page and 'data-in-flight="true"' in page and "runs/live-run.js" in page

    fragment = client.get(f"{RUNS}{run.pk}/live/")
    assert fragment.status_code == 200
    html = fragment.content.decode()
    assert 'data-in-flight="true"' in html and "<html" not in html
    assert "send_email" in html and "last heartbeat" in html and "w-1:9" in html

    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.SUCCESS, tools_executed=["send_email"])
    html = client.get(f"{RUNS}{run.pk}/live/").content.decode()
    assert 'data-in-flight="false"' in html and "The run has settled (success)" in html
    # A settled run's page has no live panel: its full timeline is shown instead.
    assert 'id="run-live"' not in client.get(f"{RUNS}{run.pk}/change/").content.decode()

    inbox_only = django_user_model.objects.create_user("ina", password="x", is_staff=True)
    inbox_only.user_permissions.add(Permission.objects.get(codename="view_webhookevent"))
    assert login(inbox_only).get(f"{RUNS}{run.pk}/live/").status_code in (403, 404)


@pytest.mark.django_db(transaction=True)  # the run executes on the agent loop, which reads the test's commits
def test_a_call_whose_tool_raised_after_starting_its_effect_is_in_doubt_on_the_desk_as_in_the_rules(admin_user):
    # The tool may have acted before it raised: its effect record stays `started`. The desk counts
    # that call in doubt, and the run as awaiting a decision on it, exactly as decide() refuses it.
    run = run_now(params=script_params(dict(UPDATE_CRM, tool_fails="the CRM timed out"),
                                       {"fail": "error", "message": "gave up"}))
    call = run.tool_calls.get(tool_name="update_crm")
    assert call.status == ToolCallStatus.FAILED
    assert replay.decide(run, force=False).code == "calls_in_doubt"
    assert list(overview.in_doubt_calls()) == [call]
    assert list(overview.awaiting_calls_in_doubt(AgentRun.objects.all())) == [run]
    assert not overview.awaiting_tools_called(AgentRun.objects.all()).exists()
    # The journal row and the API say so too (they once said only `called` calls were in doubt).
    assert call.in_doubt
    client = api(admin_user)
    calls = client.get(f"/api/runs/{run.run_id}/").json()["tool_calls"]
    assert [(c["tool_name"], c["in_doubt"]) for c in calls] == [("update_crm", True)]


def test_a_chain_that_ended_well_leaves_the_tiles_that_need_a_person(admin_user):
    """error → resume (error) → resume (success): the chain is judged by how it ended."""
    root = make_run(status=RunStatus.ERROR, tools=["send_email"], error_code="reconciled")
    AgentRun.objects.filter(pk=root.pk).update(recovery=Recovery.NEEDS_PERSON)
    middle = make_run(status=RunStatus.ERROR, tools=["send_email"], error_code="model_error")
    AgentRun.objects.filter(pk=middle.pk).update(resume_of=root, recovery=Recovery.NEEDS_PERSON)
    ToolCall.objects.create(run=root, seq=1, call_id="c-1", tool_name="send_email", effect="idempotent",
                            status=ToolCallStatus.ANSWERED)
    ToolCall.objects.create(run=middle, seq=1, call_id="c-2", tool_name="send_email", effect="idempotent",
                            status=ToolCallStatus.ANSWERED)
    client = login(admin_user)
    html = client.get(DESK).content.decode()
    # While the chain ends in a failure, a person decides (both may still be replayed by force):
    # each died, so each is counted once, under "died and waiting for a person".
    assert listed_ids(client, tile_link(html, "died-waiting")) == ids([root, middle])
    assert tile_count(html, "awaiting-tools-called") == "0"

    last = make_run(status=RunStatus.SUCCESS, tools=["send_email"])
    AgentRun.objects.filter(pk=last.pk).update(resume_of=middle)
    html = client.get(DESK).content.decode()
    for tile in ("awaiting-tools-called", "awaiting-calls-in-doubt", "awaiting-tools-unknown", "died-waiting"):
        assert tile_count(html, tile) == "0", tile
    # The rules read the same chain: the root was finished by its resume, however far down.
    assert replay.decide(AgentRun.objects.get(pk=root.pk), force=False).code == "already_resumed"
    page = client.get(f"/admin/runs/agentrun/{root.run_id}/change/").content.decode()
    assert "Resumed by" in page and str(last.run_id)[:8] in page.split('id="chain-end"')[1].split("</p>")[0]


def test_a_crash_counts_once_among_what_needs_a_person(admin_user):
    """A worker died in send_email: reconciled, its call in doubt, recovery left it to a person. It is
    one run to act on, so one tile that needs a person counts it; the others say what is behind it."""
    crash = make_run(status=RunStatus.ERROR, tools=["send_email"], error_code=RECONCILED, finished_at=timezone.now())
    AgentRun.objects.filter(pk=crash.pk).update(recovery=Recovery.NEEDS_PERSON)
    ToolCall.objects.create(run=crash, seq=1, call_id="c-1", tool_name="send_email", effect="idempotent",
                            status=ToolCallStatus.CALLED)
    html = login(admin_user).get(DESK).content.decode()
    needs_a_person = ("awaiting-calls-in-doubt", "awaiting-tools-called", "awaiting-tools-unknown", "died-waiting",
                      "approvals-waiting")
    assert {tile: tile_count(html, tile) for tile in needs_a_person} == {
        "awaiting-calls-in-doubt": "0", "awaiting-tools-called": "0", "awaiting-tools-unknown": "0",
        "died-waiting": "1", "approvals-waiting": "0",
    }
    # What is behind it, without an alert of their own: its call in doubt, its reconciliation.
    assert tile_count(html, "calls-in-doubt") == "1" and tile_count(html, "reconciled-24h") == "1"
    alerted = set(re.findall(r'class="desk-tile alert" id="([a-z0-9-]+)"', html))
    assert alerted == {"died-waiting"}
