"""The webhook inbox in the admin, driven through its URLs as logged-in support staff."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse
from django.utils import timezone

from agents.models import OutboxEmail
from runs.execution import executor
from runs.inbox import desk, processing
from runs.models.inbox import EventStatus, WebhookEvent, WebhookSource
from runs.models.ledger import AgentRun, RunStatus
from runs.services import run as services
from tests.helpers import LOOKUP, SAY_DONE, SEND_EMAIL
from tests.inbox.test_webhooks import FAIL, SECRET, attachment, deliver, make_source
from tests.kit import login

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed

CHANGELIST = "/admin/runs/webhookevent/"


@pytest.fixture(autouse=True)
def _inbox(no_inbox_worker, settings, tmp_path):
    settings.WEBHOOK_ATTACHMENTS_DIR = tmp_path / "webhook-attachments"
    settings.WEBHOOK_MAX_ATTEMPTS = 1


def texts(response) -> list[tuple[str, str]]:
    return [(m.level_tag, m.message) for m in response.context["messages"]]


def act(client, action: str, events, **extra):
    data = {"action": action, "_selected_action": [str(e.pk) for e in events], **extra}
    return client.post(CHANGELIST, data, follow=True)


def processed_event(script, message_id="m-1", **payload) -> WebhookEvent:
    WebhookSource.objects.filter(slug="inbound-email").exists() or make_source(script=script)
    WebhookSource.objects.filter(slug="inbound-email").update(params={"script": list(script)})
    event_id = deliver(payload or {"text": "Refund?"}, message_id=message_id).json()["event_id"]
    processing.process_event(event_id=event_id)
    return WebhookEvent.objects.get(pk=event_id)


@committed
def test_the_inbox_lists_status_source_attempts_next_attempt_last_error_and_runs(support_agent):
    review = processed_event([SEND_EMAIL, FAIL], message_id="needs-a-person")
    done = processed_event([LOOKUP, SAY_DONE], message_id="fine")

    page = login(support_agent).get(CHANGELIST)
    assert page.status_code == 200
    html = page.content.decode()
    for column in ("status", "source", "attempts", "next_attempt_at", "last_error_short", "runs_links"):
        assert f"column-{column}" in html, column
    assert "needs review" in html and "Inbound email" in html
    assert "called send_email before failing" in html
    for event in (review, done):
        run = event.runs.get()
        assert reverse("admin:runs_agentrun_change", args=[run.run_id]) in html
    assert f"{str(done.runs.get().run_id)[:8]} (success)" in html
    # Filters by status and source.
    filtered = login(support_agent).get(CHANGELIST, {"status__exact": "needs_review"}).content.decode()
    assert "needs-a-person" in filtered and "fine</td>" not in filtered


@committed
def test_an_events_page_shows_payload_attachments_and_attempts(support_agent):
    event = processed_event([LOOKUP, SAY_DONE], text="Refund?", attachments=[attachment()])
    client = login(support_agent)
    html = client.get(reverse("admin:runs_webhookevent_change", args=[event.pk])).content.decode()
    assert "Refund?" in html and "invoice.txt" in html
    assert str(event.runs.get().run_id)[:8] in html
    assert "lookup_customer" in html
    assert 'id="retry_now-button"' in html and 'id="mark_resolved-button"' in html
    assert 'id="force_reprocess-button"' not in html  # no force permission
    assert event.attachments[0]["path"] not in html
    download = client.get(reverse("admin:runs_webhookevent_attachment", args=[event.pk, 0]))
    assert download.status_code == 200
    assert b"".join(download.streaming_content) == b"Invoice 42: 19.99 EUR"
    assert client.get(reverse("admin:runs_webhookevent_attachment", args=[event.pk, 5])).status_code == 404


@committed
def test_retry_now_follows_the_same_rules(support_agent):
    dead = processed_event([FAIL], message_id="dead-one")
    review = processed_event([SEND_EMAIL, FAIL], message_id="review-one")
    assert (dead.status, review.status) == ("dead", "needs_review")

    response = act(login(support_agent), "retry_now", [dead, review])

    messages = texts(response)
    assert any(level == "success" and "Event dead-one" in text and "retrying as run" in text
               for level, text in messages), messages
    refused = next(text for level, text in messages if level == "warning")
    assert "Event review-one" in refused
    assert "already called send_email before failing" in refused
    assert "Use “Force reprocess…” to process it again anyway." in refused
    dead.refresh_from_db()
    review.refresh_from_db()
    assert dead.status == EventStatus.PROCESSING and dead.runs.count() == 2
    assert review.status == EventStatus.NEEDS_REVIEW and review.runs.count() == 1
    retry = dead.runs.latest("created_at")
    assert (retry.status, retry.replay_of_id) == (RunStatus.QUEUED, dead.runs.earliest("created_at").run_id)
    # The worker that takes the task executes that run (and only that one).
    WebhookSource.objects.update(params={"script": [SAY_DONE]})
    AgentRun.objects.filter(pk=retry.pk).update(config={**retry.config, "params": {"script": [SAY_DONE]}})
    assert processing.process_event(event_id=dead.pk) == EventStatus.DONE
    assert dead.runs.count() == 2
    assert LogEntry.objects.filter(object_id=str(dead.pk), change_message__startswith="Retried now").exists()


@committed
def test_retry_now_refuses_an_event_in_flight_or_closed(support_agent):
    done = processed_event([LOOKUP, SAY_DONE], message_id="done-one")
    WebhookEvent.objects.filter(pk=done.pk)
    in_flight = processed_event([LOOKUP, SAY_DONE], message_id="busy")
    WebhookEvent.objects.filter(pk=in_flight.pk).update(status=EventStatus.PROCESSING)

    messages = texts(act(login(support_agent), "retry_now", [done, in_flight]))
    assert [level for level, _ in messages] == ["warning", "warning"]
    assert "already done" in messages[0][1]
    assert "being processed" in messages[1][1]
    assert AgentRun.objects.count() == 2


@committed
def test_force_reprocess_needs_the_permission(support_agent):
    event = processed_event([SEND_EMAIL, FAIL])
    response = login(support_agent).post(
        CHANGELIST, {"action": "force_reprocess", "_selected_action": [str(event.pk)]}, follow=True
    )
    assert response.status_code == 200
    assert AgentRun.objects.count() == 1
    html = login(support_agent).get(CHANGELIST).content.decode()
    assert "Force reprocess" not in html


@committed
def test_force_reprocess_confirms_with_what_was_called_then_records_the_reason(support_lead):
    event = processed_event([SEND_EMAIL, FAIL])
    client = login(support_lead)

    confirm = client.post(CHANGELIST, {"action": "force_reprocess", "_selected_action": [str(event.pk)]})
    assert confirm.status_code == 200
    html = confirm.content.decode()
    assert "Force reprocess" in html
    assert "Already called: send_email" in html
    assert "send_email({" in html
    assert "Forcing overrides:" in html and "Use “Force reprocess…”" in html
    assert 'name="reason"' in html

    no_reason = client.post(CHANGELIST, {"action": "force_reprocess", "_selected_action": [str(event.pk)],
                                         "post": "yes", "reason": "  "})
    assert "Give a reason" in no_reason.content.decode()
    assert AgentRun.objects.count() == 1

    done = client.post(CHANGELIST, {"action": "force_reprocess", "_selected_action": [str(event.pk)],
                                    "post": "yes", "reason": "Jane never got the email; checked with her."},
                       follow=True)
    assert any("Force-reprocessed as run" in text for _, text in texts(done))
    event.refresh_from_db()
    forced = event.runs.latest("created_at")
    assert (forced.forced, forced.forced_by, forced.force_reason) == (
        True, support_lead, "Jane never got the email; checked with her.")
    assert forced.status == RunStatus.QUEUED and event.status == EventStatus.PROCESSING
    assert LogEntry.objects.filter(object_id=str(event.pk), change_message__contains="overriding “tools_called”").exists()

    # The worker runs the forced attempt. The event is its attempts' one intent: the email the first
    # attempt recorded as sent is served from its record, not sent a second time.
    AgentRun.objects.filter(pk=forced.pk).update(config={**forced.config, "params": {"script": [SEND_EMAIL, SAY_DONE]}})
    assert processing.process_event(event_id=event.pk) == EventStatus.DONE
    assert OutboxEmail.objects.count() == 1
    assert forced.tool_calls.get().status == "deduplicated"


@committed
def test_force_reprocess_cannot_override_a_run_in_flight(support_lead):
    event = processed_event([LOOKUP, SAY_DONE])
    AgentRun.objects.filter(webhook_event=event).update(status=RunStatus.QUEUED)
    with pytest.raises(Exception) as refused:
        desk.force_reprocess_event(event.pk, actor=support_lead, reason="try")
    assert getattr(refused.value, "code", "") == "run_in_flight"
    assert AgentRun.objects.count() == 1


@committed
def test_mark_resolved_closes_the_event_for_good(support_agent):
    review = processed_event([SEND_EMAIL, FAIL], message_id="handled-by-phone")
    done = processed_event([LOOKUP, SAY_DONE], message_id="fine")
    messages = texts(act(login(support_agent), "mark_resolved", [review, done]))
    assert ("success", "Event handled-by-phone (%s): marked resolved." % str(review.pk)[:8]) in messages
    assert any(level == "warning" and "is done: there is nothing to resolve" in text for level, text in messages)
    review.refresh_from_db()
    assert (review.status, review.resolved_by) == (EventStatus.RESOLVED, support_agent)
    assert processing.process_due() == 0
    assert processing.sweep() == []
    # Closed: “Retry now” refuses, only forcing reopens it.
    refused = texts(act(login(support_agent), "retry_now", [review]))
    assert "already resolved" in refused[0][1]


@committed
def test_events_are_records_not_forms(support_lead):
    event = processed_event([LOOKUP, SAY_DONE])
    client = login(support_lead)
    assert client.get("/admin/runs/webhookevent/add/").status_code == 403
    assert client.post(f"/admin/runs/webhookevent/{event.pk}/delete/").status_code == 403


# --- Sources ---------------------------------------------------------------------------------------


def source_form(**overrides) -> dict:
    data = {
        "slug": "forms", "name": "Contact form", "enabled": "on", "agent_name": "support", "owner_id": "web",
        "instructions": "Someone filled in the contact form.", "params": "{}",
        "new_secret": "a-long-shared-secret-0001", "signature_scheme": "timestamped", "message_id_header": "",
        "message_id_field": "submission.id",
    }
    data.update(overrides)
    return data


def test_a_source_is_configured_in_the_admin_and_its_secret_is_never_shown(admin_client):
    created = admin_client.post("/admin/runs/webhooksource/add/", source_form(), follow=True)
    assert created.status_code == 200
    source = WebhookSource.objects.get(slug="forms")
    assert source.secret == "a-long-shared-secret-0001"

    listing = admin_client.get("/admin/runs/webhooksource/").content.decode()
    change = admin_client.get(f"/admin/runs/webhooksource/{source.pk}/change/").content.decode()
    for html in (listing, change):
        assert "a-long-shared-secret-0001" not in html
        assert "set (25 characters)" in html
    assert "POST /api/webhooks/forms/" in listing

    # Saved without a new secret: the old one stays.
    admin_client.post(f"/admin/runs/webhooksource/{source.pk}/change/", source_form(new_secret="", name="Contact"))
    source.refresh_from_db()
    assert (source.name, source.secret) == ("Contact", "a-long-shared-secret-0001")


@pytest.mark.parametrize(
    "overrides, field, fragment",
    [
        ({"new_secret": ""}, "new_secret", "required"),
        ({"new_secret": "short"}, "new_secret", "at least 16"),
        ({"agent_name": "nobody"}, "agent_name", "Select a valid choice"),
        ({"message_id_field": ""}, "message_id_header", "header name or a JSON field path"),
        ({"message_id_header": "X-Id"}, "message_id_header", "one of them"),
        ({"message_id_field": "a..b"}, "message_id_field", "dotted names"),
        ({"params": '{"script": [{"call": "launch_rocket"}]}'}, "params", "no tool named"),
    ],
)
def test_a_bad_source_is_refused_with_a_message(admin_client, overrides, field, fragment):
    response = admin_client.post("/admin/runs/webhooksource/add/", source_form(**overrides))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert fragment in " ".join(errors.get(field, [])), errors
    assert not WebhookSource.objects.exists()


def test_a_source_whose_agent_was_retired_is_refused_on_save():
    source = make_source()
    source.agent_name = "retired"
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError) as refused:
        source.full_clean()
    assert "There is no agent named 'retired'" in str(refused.value)
    assert SECRET not in str(refused.value)


@committed
def test_an_event_whose_run_a_person_resumed_waits_for_the_resume_then_closes(support_agent, model_down_at_second_call):
    # The processor died after the attempt failed (the event is still `processing`, its lease
    # run out) and a person resumed the run from the run desk before the event was looked at again.
    event = processed_event([SEND_EMAIL, SAY_DONE], message_id="resumed")
    original = event.runs.get()
    assert original.status == RunStatus.ERROR
    model_down_at_second_call()  # the provider is back
    past = timezone.now() - timedelta(minutes=5)
    WebhookEvent.objects.filter(pk=event.pk).update(status=EventStatus.PROCESSING, lease_expires_at=past, last_error="")
    resumed = services.resume_run(original.run_id, actor=support_agent)

    # While the resume continues the run, the event waits: nobody needs to review it.
    assert processing.claim_event(event_id=event.pk, worker="w1").run_id is None
    event.refresh_from_db()
    assert event.status == EventStatus.PROCESSING and event.last_error == ""

    executor.execute(resumed.run_id)
    assert AgentRun.objects.get(pk=resumed.pk).status == RunStatus.SUCCESS
    WebhookEvent.objects.filter(pk=event.pk).update(lease_expires_at=past)
    processing.claim_event(event_id=event.pk, worker="w2")
    event.refresh_from_db()
    assert event.status == EventStatus.DONE, event.last_error
    assert f"finished by its resume, run {resumed.run_id}" in event.last_error
    assert OutboxEmail.objects.count() == 1
