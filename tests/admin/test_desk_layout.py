"""The desk as people read it: the day chart by local day, the admin's links and wording."""

from __future__ import annotations

import zoneinfo
from datetime import datetime

import pytest

from runs.rules import overview
from tests.factories import make_run

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("zone", ["Asia/Tokyo", "America/New_York", "Asia/Kolkata"])
def test_the_day_chart_counts_runs_by_local_day_across_midnight(settings, zone):
    settings.TIME_ZONE = zone
    local = zoneinfo.ZoneInfo(zone)
    now = datetime(2026, 3, 10, 1, 30, tzinfo=local)
    for created in (datetime(2026, 3, 9, 23, 40, tzinfo=local), datetime(2026, 3, 10, 0, 20, tzinfo=local),
                    datetime(2026, 3, 10, 1, 5, tzinfo=local), datetime(2026, 3, 4, 0, 10, tzinfo=local)):
        make_run(status="success", created_at=created)

    daily = overview.build_overview(now=now).daily
    labels = [bucket.start.astimezone(local).strftime("%a %d") for bucket in daily]
    assert labels == ["Wed 04", "Thu 05", "Fri 06", "Sat 07", "Sun 08", "Mon 09", "Tue 10"]
    assert [bucket.total for bucket in daily] == [1, 0, 0, 0, 0, 1, 2]
    assert all(bucket.start.astimezone(local).hour == 0 for bucket in daily)


def test_the_day_chart_labels_today_in_the_admin(settings, admin_client):
    from django.utils import timezone

    settings.TIME_ZONE = "Pacific/Kiritimati"  # UTC+14: the local day is rarely the UTC one
    make_run(status="success")
    html = admin_client.get("/admin/desk/").content.decode()
    daily = html[html.index('id="chart-daily"'):]
    daily = daily[: daily.index("</div>")]
    assert timezone.localtime().strftime("%a %d") in daily


def test_a_worker_shutdown_is_said_as_one_not_as_a_client_abort():
    from runs.ledger.timeline import timeline_items

    event = {"timestamp": 1.0, "author": "support", "text": "", "function_calls": [], "error_code": "",
             "function_responses": [{"id": "c1", "name": "send_email", "aborted": True,
                                     "response": {"error": "Invocation was aborted by client."}}]}
    (item,) = timeline_items([event], error_code="worker_shutdown")
    assert item["title"] == "send_email was stopped before it answered: the worker shut down"
    assert "client" not in str(item)
    stopped = dict(event, function_responses=[], error_code="INVOCATION_ABORTED",
                   error_message="Invocation was aborted by client.")
    (item,) = timeline_items([stopped], error_code="worker_shutdown")
    assert item["text"] == "Aborted: the worker shut down." and "client" not in str(item)


def test_one_tool_called_is_it_and_the_force_page_does_not_send_you_to_itself(admin_client):
    from runs.rules import replay
    from tests.factories import with_journal

    one = with_journal(make_run(status="error", tools=["send_email"]), [("send_email", "effectful", "answered")])
    refusal = replay.decide(one, force=False).refusal
    assert "a replay would call it again." in refusal.detail
    two = make_run(status="error", tools=["send_email", "update_crm"])
    assert "a replay would call them again." in replay.decide(two, force=False).refusal.detail

    page = admin_client.post("/admin/runs/agentrun/", {"action": "force_replay_selected", "_selected_action": [one.pk]})
    html = page.content.decode()
    assert "Forcing overrides: This run already called send_email before failing: a replay would call it again." in html
    assert "Use “Force replay…”" not in html
