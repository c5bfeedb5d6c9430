"""The durable webhook inbox: receipt, idempotency, processing by runs, retries, the desk."""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from agents.models import AdkEvent, OutboxEmail
from runs.inbox import attempts, processing, receipt, signing
from runs.ledger import lifecycle
from runs.models.inbox import EventStatus, WebhookEvent, WebhookSource
from runs.models.ledger import AgentRun, RunStatus, Trigger
from runs.services import run as services
from tests.helpers import BASE_DIR, LOOKUP, SAY_DONE, SEND_EMAIL, child_env, postgres_only, wait_until

# Events are processed by runs on the agent loop, and worker processes race over them.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed

SECRET = "correct-horse-battery-staple-42"
URL = "/api/webhooks/inbound-email/"
FAIL = {"fail": "error", "message": "The model is down."}


@pytest.fixture(autouse=True)
def _inbox_settings(settings, tmp_path):
    settings.WEBHOOK_ATTACHMENTS_DIR = tmp_path / "webhook-attachments"
    settings.WEBHOOK_MAX_BYTES = 64 * 1024
    settings.WEBHOOK_RETRY_DELAYS = [5, 30, 120, 600, 1800, 3600]
    settings.WEBHOOK_MAX_ATTEMPTS = 8


def make_source(script=(LOOKUP, SAY_DONE), **fields) -> WebhookSource:
    defaults = dict(
        slug="inbound-email",
        name="Inbound email",
        agent_name="support",
        owner_id="jane",
        secret=SECRET,
        message_id_header="X-Message-Id",
        expects_attachments=True,
        instructions="A customer wrote to support. Answer them.",
        params={"script": list(script)},
    )
    defaults.update(fields)
    return WebhookSource.objects.create(**defaults)


@pytest.fixture
def source():
    return make_source()


def attachment(name="invoice.txt", data=b"Invoice 42: 19.99 EUR", content_type="text/plain") -> dict:
    return {"filename": name, "content_type": content_type, "content_base64": base64.b64encode(data).decode()}


def deliver(payload=None, *, message_id="msg-1", secret=SECRET, body: bytes | None = None, url=URL,
            client: Client | None = None, signature: str | None = None, signed_id: str | None = None, **headers):
    """POST a delivery signed the timestamped way; `signed_id` is the id to sign when it is a body field."""
    if body is None:
        body = json.dumps(payload if payload is not None else {"from": "jane@example.com", "text": "Refund?"}).encode()
    sent = {"X-Message-Id": message_id, **headers}
    if signature is None:
        signature = signing.sign_timestamped(secret, body, message_id=message_id if signed_id is None else signed_id)
    if signature:
        sent["X-Signature"] = signature
    return (client or Client()).post(url, data=body, content_type="application/json", headers=sent)


def stored_dirs(settings) -> list[Path]:
    root = Path(settings.WEBHOOK_ATTACHMENTS_DIR)
    return sorted(root.iterdir()) if root.exists() else []


# --- Receipt ---------------------------------------------------------------------------------------


def test_a_signed_event_is_stored_with_its_attachment_copied_before_the_answer(source, announced_events, settings):
    response = deliver({"from": "jane@example.com", "text": "Refund?", "attachments": [attachment()]},
                       **{"User-Agent": "provider/1.0"})

    assert response.status_code == 202, response.content
    body = response.json()
    assert body["status"] == "received" and body["duplicate"] is False
    event = WebhookEvent.objects.get(pk=body["event_id"])
    assert (event.source, event.external_id, event.status, event.attempts) == (source, "msg-1", "received", 0)
    # The payload keeps what the attachments are, not their bytes; the bytes are on disk.
    assert event.payload["attachments"] == [{"filename": "invoice.txt", "content_type": "text/plain", "size": 21}]
    stored = event.attachments[0]
    assert Path(stored["path"]).read_bytes() == b"Invoice 42: 19.99 EUR"
    assert Path(stored["path"]).parent == Path(settings.WEBHOOK_ATTACHMENTS_DIR) / str(event.event_id)
    assert "path" not in response.content.decode()
    # A useful subset of the headers, never the signature.
    assert event.headers["User-Agent"] == "provider/1.0"
    assert event.headers["X-Message-Id"] == "msg-1"
    assert "X-Signature" not in event.headers
    assert announced_events == [str(event.event_id)]


def test_the_message_id_can_come_from_a_json_field(announced_events):
    make_source(slug="forms", message_id_header="", message_id_field="submission.id", expects_attachments=False)
    url = "/api/webhooks/forms/"
    first = deliver({"submission": {"id": 981, "name": "Jane"}}, url=url, message_id="ignored", signed_id="981")
    again = deliver({"submission": {"id": 981, "name": "Jane, again"}}, url=url, message_id="x", signed_id="981")
    other = deliver({"submission": {"id": "982"}}, url=url, signed_id="982")
    assert (first.status_code, again.status_code, other.status_code) == (202, 200, 202)
    assert again.json()["event_id"] == first.json()["event_id"]
    assert sorted(WebhookEvent.objects.values_list("external_id", flat=True)) == ["981", "982"]


def test_the_same_message_id_again_answers_200_with_the_first_event_and_stores_nothing(source, announced_events, settings):
    first = deliver({"text": "one", "attachments": [attachment()]})
    second = deliver({"text": "one, redelivered", "attachments": [attachment(data=b"other bytes")]})

    assert first.status_code == 202
    assert second.status_code == 200
    assert second.json() == {"event_id": first.json()["event_id"], "status": "received", "duplicate": True}
    assert WebhookEvent.objects.count() == 1
    assert WebhookEvent.objects.get().payload["text"] == "one"
    assert len(stored_dirs(settings)) == 1
    assert len(announced_events) == 1


def _nothing_stored(settings) -> None:
    assert WebhookEvent.objects.count() == 0
    assert stored_dirs(settings) == []


@pytest.mark.parametrize(
    "case, status, code, fragment",
    [
        # Every delivery nobody authenticated hears the same answer (tests/inbox/test_webhook_signing.py).
        ("bad signature", 404, "not_accepted", "No webhook source here accepts this delivery"),
        ("missing signature", 404, "not_accepted", "No webhook source here accepts this delivery"),
        ("signature without timestamp", 404, "not_accepted", "No webhook source here accepts this delivery"),
        ("signature of other bytes", 404, "not_accepted", "No webhook source here accepts this delivery"),
        ("unknown source", 404, "not_accepted", "No webhook source here accepts this delivery"),
        ("disabled source", 404, "not_accepted", "No webhook source here accepts this delivery"),
        ("malformed JSON", 400, "malformed_event", "not valid JSON"),
        ("not an object", 400, "malformed_event", "JSON object"),
        ("not UTF-8", 400, "malformed_event", "UTF-8"),
        ("oversized body", 413, "body_too_large", "WEBHOOK_MAX_BYTES"),
        # The header id is signed: without it, the signature cannot be checked.
        ("no message id", 404, "not_accepted", "No webhook source here accepts this delivery"),
        ("bad base64", 400, "bad_attachments", "not valid base64"),
        ("path in file name", 400, "bad_attachments", "contains a path"),
        ("same file twice", 400, "bad_attachments", "used twice"),
        ("attachment too large", 413, "body_too_large", "MAX_UPLOAD_BYTES"),
    ],
)
def test_bad_deliveries_are_refused_with_a_message_and_nothing_is_stored(
    source, announced_events, settings, caplog, case, status, code, fragment
):
    caplog.set_level(logging.DEBUG)
    ok = json.dumps({"text": "hi"}).encode()
    if case == "bad signature":
        response = deliver(body=ok, secret="not-the-secret-at-all-0000")
    elif case == "missing signature":
        response = deliver(body=ok, signature="")
    elif case == "signature without timestamp":
        signature = signing.sign_timestamped(SECRET, ok, message_id="msg-1")
        response = deliver(body=ok, signature=signature.split(",", 1)[1])
    elif case == "signature of other bytes":
        other = json.dumps({"text": "hi"}, indent=1).encode()
        response = deliver(body=ok, signature=signing.sign_timestamped(SECRET, other, message_id="msg-1"))
    elif case == "unknown source":
        response = deliver(body=ok, url="/api/webhooks/nobody/")
    elif case == "disabled source":
        WebhookSource.objects.filter(pk=source.pk).update(enabled=False)
        response = deliver(body=ok)
    elif case == "malformed JSON":
        response = deliver(body=b'{"text": "hi",')
    elif case == "not an object":
        response = deliver(body=b'["hi"]')
    elif case == "not UTF-8":
        response = deliver(body=b'{"text": "\xff\xfe"}')
    elif case == "oversized body":
        response = deliver({"text": "x" * (settings.WEBHOOK_MAX_BYTES + 1)})
    elif case == "no message id":
        response = deliver(body=ok, message_id="")
    elif case == "bad base64":
        response = deliver({"attachments": [{"filename": "a.txt", "content_base64": "not base64!"}]})
    elif case == "path in file name":
        response = deliver({"attachments": [attachment(name="../../etc/passwd")]})
    elif case == "same file twice":
        response = deliver({"attachments": [attachment(), attachment(data=b"again")]})
    elif case == "attachment too large":
        settings.MAX_UPLOAD_BYTES = 10
        response = deliver({"attachments": [attachment(data=b"eleven byte")]})
    else:
        raise AssertionError(case)

    assert response.status_code == status, response.content
    assert response.json()["code"] == code
    assert fragment in response.json()["detail"]
    _nothing_stored(settings)
    assert announced_events == []
    # The secret is never said back, nor logged.
    assert SECRET not in response.content.decode()
    assert SECRET not in caplog.text


def test_a_source_without_attachments_refuses_them(announced_events, settings):
    make_source(expects_attachments=False)
    response = deliver({"attachments": [attachment()]})
    assert response.status_code == 400
    assert response.json()["code"] == "bad_attachments"
    _nothing_stored(settings)


def test_a_declared_length_over_the_limit_is_refused_before_reading(source, announced_events, settings):
    body = json.dumps({"text": "x" * 100}).encode()
    response = Client().generic(
        "POST", URL, data=body, content_type="application/json",
        headers={"X-Signature": signing.sign_timestamped(SECRET, body, message_id="m"), "X-Message-Id": "m"},
        CONTENT_LENGTH=str(settings.WEBHOOK_MAX_BYTES + 1),
    )
    assert response.status_code == 413
    assert response.json()["code"] == "body_too_large"
    _nothing_stored(settings)


def test_a_failure_while_storing_leaves_nothing_behind(source, announced_events, settings, monkeypatch):
    def explode(**kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(WebhookEvent.objects, "create", explode)
    with pytest.raises(RuntimeError):
        receipt.receive_event(
            slug=source.slug,
            body=(body := json.dumps({"attachments": [attachment()]}).encode()),
            headers={"X-Signature": signing.sign_timestamped(SECRET, body, message_id="m-1"), "X-Message-Id": "m-1"},
        )
    _nothing_stored(settings)


@postgres_only
@committed
def test_twenty_concurrent_deliveries_store_one_event_and_start_one_run(source, announced_events, settings):
    body = json.dumps({"text": "Refund?", "attachments": [attachment()]}).encode()
    barrier = threading.Barrier(20)
    answers: list = []
    lock = threading.Lock()

    def post() -> None:
        try:
            connection.ensure_connection()
            client = Client()
            barrier.wait(timeout=60)
            response = deliver(body=body, message_id="same-message", client=client)
            with lock:
                answers.append((response.status_code, response.json()))
        finally:
            connection.close()

    threads = [threading.Thread(target=post) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert len(answers) == 20
    assert sorted(code for code, _ in answers) == [200] * 19 + [202]
    assert len({body["event_id"] for _, body in answers}) == 1
    assert WebhookEvent.objects.count() == 1
    assert len(stored_dirs(settings)) == 1  # the losers removed their copies
    assert len(announced_events) == 1

    # Every task delivered (and delivered again) starts one run between them.
    event_id = answers[0][1]["event_id"]
    for _ in range(3):
        processing.process_event(event_id=event_id)
    event = WebhookEvent.objects.get(pk=event_id)
    assert event.status == EventStatus.DONE
    assert event.runs.count() == 1


# --- Processing ------------------------------------------------------------------------------------


@committed
def test_an_event_is_processed_by_a_webhook_run_with_its_attachment_as_input(source, announced_events, settings):
    event_id = deliver({"from": "jane@example.com", "attachments": [attachment()]}).json()["event_id"]

    assert processing.process_event(event_id=event_id) == EventStatus.DONE

    event = WebhookEvent.objects.get(pk=event_id)
    run = event.runs.get()
    assert (event.status, event.attempts, event.last_error, event.lease_expires_at) == ("done", 1, "", None)
    assert (run.trigger, run.status, run.created_by, run.owner_id) == (Trigger.WEBHOOK, "success", None, "jane")
    assert run.tools_executed == ["lookup_customer"]
    assert "A customer wrote to support" in run.message and '"from": "jane@example.com"' in run.message
    # The run's input is its own copy of the event's stored copy.
    assert run.input_file_name == "invoice.txt"
    assert run.input_file != event.attachments[0]["path"]
    assert Path(run.input_file).read_bytes() == b"Invoice 42: 19.99 EUR"
    # Processed again (django-q2 delivers at least once): nothing happens.
    assert processing.process_event(event_id=event_id) == "not claimed"
    assert AgentRun.objects.count() == 1


@committed
def test_a_duplicate_delivery_after_processing_starts_no_second_run(source, announced_events):
    first = deliver({"text": "one"})
    processing.process_event(event_id=first.json()["event_id"])
    again = deliver({"text": "one"})
    assert again.status_code == 200
    assert again.json() == {"event_id": first.json()["event_id"], "status": "done", "duplicate": True}
    assert processing.process_due() == 0
    assert AgentRun.objects.count() == 1


def test_retry_delays_back_off_and_are_capped(settings):
    settings.WEBHOOK_RETRY_DELAYS = [5, 30, 120, 600]
    assert [processing.retry_delay(n) for n in range(1, 8)] == [5, 30, 120, 600, 600, 600, 600]


@committed
def test_a_failure_without_tool_calls_is_retried_with_backoff_until_dead(announced_events, settings):
    settings.WEBHOOK_MAX_ATTEMPTS = 5
    make_source(script=[FAIL])
    event_id = deliver().json()["event_id"]

    waits = []
    for attempt in range(1, 6):
        status = processing.process_event(event_id=event_id)
        event = WebhookEvent.objects.get(pk=event_id)
        assert event.attempts == attempt
        if attempt < 5:
            assert status == EventStatus.RETRY_WAIT
            waits.append(round((event.next_attempt_at - event.runs.latest("created_at").finished_at).total_seconds()))
            assert "called no tool, so it is retried" in event.last_error
            # Not before it is due.
            assert processing.process_event(event_id=event_id) == "not claimed"
            assert processing.sweep() == []
            # Time passes: the retry is due, and the sweeper hands it to a worker.
            WebhookEvent.objects.filter(pk=event_id).update(next_attempt_at=timezone.now() - timedelta(seconds=1))
            assert processing.sweep() == [event.event_id]
    assert waits == [5, 30, 120, 600]

    event = WebhookEvent.objects.get(pk=event_id)
    assert event.status == EventStatus.DEAD
    assert "Gave up after 5 attempts (WEBHOOK_MAX_ATTEMPTS=5)" in event.last_error
    assert "The model is down." in event.last_error
    runs = list(event.runs.order_by("created_at"))
    assert len(runs) == 5
    assert all(run.status == RunStatus.ERROR and run.tools_executed == [] for run in runs)
    # Each retry is a new run that replays the one before it, never two at once.
    assert [run.replay_of_id for run in runs] == [None] + [run.run_id for run in runs[:-1]]
    assert all(later.created_at >= earlier.finished_at for earlier, later in zip(runs, runs[1:]))
    assert processing.process_event(event_id=event_id) == "not claimed"
    assert processing.sweep() == []


@committed
def test_a_failure_after_a_tool_call_is_not_retried_but_waits_for_review(announced_events):
    make_source(script=[SEND_EMAIL, FAIL])
    event_id = deliver().json()["event_id"]

    assert processing.process_event(event_id=event_id) == EventStatus.NEEDS_REVIEW

    event = WebhookEvent.objects.get(pk=event_id)
    assert event.attempts == 1
    assert "called send_email before failing" in event.last_error
    assert "Force reprocess…" in event.last_error and "Mark resolved" in event.last_error
    assert OutboxEmail.objects.count() == 1
    # Nobody picks it up by themselves.
    assert processing.process_event(event_id=event_id) == "not claimed"
    assert processing.process_due() == 0
    WebhookEvent.objects.filter(pk=event_id).update(received_at=timezone.now() - timedelta(days=1))
    assert processing.sweep() == []
    assert OutboxEmail.objects.count() == 1


@committed
def test_a_failure_whose_tools_are_unknown_waits_for_review(source, announced_events):
    event_id = deliver().json()["event_id"]
    processing.process_event(event_id=event_id)
    event = WebhookEvent.objects.get(pk=event_id)
    # As if the attempt had failed with no evidence either way (e.g. its journal was unreadable).
    event.runs.update(status=RunStatus.ERROR, tools_executed=None, error_code="agent_error")
    WebhookEvent.objects.filter(pk=event_id).update(status=EventStatus.PROCESSING,
                                                    lease_expires_at=timezone.now() - timedelta(seconds=1))

    assert processing.process_event(event_id=event_id) == EventStatus.NEEDS_REVIEW
    assert "unknown whether it called any tool" in WebhookEvent.objects.get(pk=event_id).last_error


def test_a_run_in_flight_is_never_joined_by_a_second_one(source, announced_events):
    event_id = deliver().json()["event_id"]
    claim = processing.claim_event(event_id=event_id, worker="w1")
    assert claim.run_id is not None
    run = AgentRun.objects.get(pk=claim.run_id)
    # The worker claimed the run, then its lease ran out while the run is still alive.
    lifecycle.claim_run(run_id=run.run_id, worker="w1")
    WebhookEvent.objects.filter(pk=event_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))

    second = processing.claim_event(event_id=event_id, worker="w2")
    assert second is not None and second.run_id is None
    assert AgentRun.objects.count() == 1
    # The database refuses a second run in flight for the event whatever path tries it.
    from django.db import IntegrityError, transaction

    with pytest.raises(IntegrityError), transaction.atomic():
        AgentRun.objects.create(agent_name="support", owner_id="jane", config={"message": "x", "params": {}},
                                session_id="s", webhook_event_id=event_id)


def test_the_sweeper_names_what_is_due_and_the_workers_claim_it(source, announced_events, settings):
    now = timezone.now()

    def event(name, **fields):
        return WebhookEvent.objects.create(source=source, external_id=name, payload={}, **fields)

    received = event("received", status="received")
    due = event("due", status="retry_wait", next_attempt_at=now - timedelta(seconds=1))
    later = event("later", status="retry_wait", next_attempt_at=now + timedelta(seconds=30))
    expired = event("expired", status="processing", lease_expires_at=now - timedelta(seconds=1))
    leased = event("leased", status="processing", lease_expires_at=now + timedelta(seconds=60))
    for name, status in [("review", "needs_review"), ("dead", "dead"), ("done", "done"), ("resolved", "resolved")]:
        event(name, status=status)

    assert set(processing.sweep()) == {received.pk, due.pk, expired.pk}
    # Nothing is handed anywhere: the table is the queue, and a worker claims from it.
    claimed = {processing.claim_next(worker="w1").event_id for _ in range(3)}
    assert claimed == {received.pk, due.pk, expired.pk}
    assert processing.claim_next(worker="w1") is None
    assert {later.pk, leased.pk}.isdisjoint(claimed)


def test_the_sweeper_is_a_periodic_job():
    from django_q.models import Schedule

    from runs.tasks import sweep_webhooks
    from runs.upkeep.periodic_jobs import setup_schedules

    assert setup_schedules()["runs.webhook_sweeper"] == "created"
    job = Schedule.objects.get(name="runs.webhook_sweeper")
    assert (job.func, job.schedule_type, job.minutes) == ("runs.tasks.sweep_webhooks", Schedule.MINUTES, 1)
    assert sweep_webhooks() == "0 webhook event(s) due"


@committed
def test_attachments_are_copied_at_receipt_and_a_replay_of_the_events_run_uses_the_copy(
    announced_events, settings, support_lead
):
    settings.WEBHOOK_MAX_ATTEMPTS = 1
    make_source(script=[FAIL])
    event_id = deliver({"attachments": [attachment(data=b"Please refund order 42.")]}).json()["event_id"]
    event = WebhookEvent.objects.get(pk=event_id)
    assert Path(event.attachments[0]["path"]).read_bytes() == b"Please refund order 42."

    assert processing.process_event(event_id=event_id) == EventStatus.DEAD
    original = WebhookEvent.objects.get(pk=event_id).runs.get()
    assert original.tools_executed == [] and original.input_file_sha256

    replay = services.replay_run(original.run_id, actor=support_lead)
    assert (replay.input_file, replay.input_file_sha256) == (original.input_file, original.input_file_sha256)
    from runs.execution import executor

    AgentRun.objects.filter(pk=replay.pk).update(config={**replay.config, "params": {"script": [SAY_DONE]}})
    executor.execute(replay.run_id)
    replay.refresh_from_db()
    assert replay.status == RunStatus.SUCCESS
    first = AdkEvent.objects.filter(session_id=replay.session_id).order_by("timestamp").first()
    assert first.parts[1]["inline_data"]["display_name"] == "invoice.txt"
    assert base64.b64decode(first.parts[1]["inline_data"]["data"]) == b"Please refund order 42."


@committed
def test_an_event_whose_source_cannot_start_a_run_waits_for_review(source, announced_events):
    event_id = deliver().json()["event_id"]
    WebhookSource.objects.filter(pk=source.pk).update(agent_name="retired-agent")
    assert processing.process_event(event_id=event_id) == EventStatus.NEEDS_REVIEW
    event = WebhookEvent.objects.get(pk=event_id)
    assert "No run could be started" in event.last_error and "retired-agent" in event.last_error
    assert AgentRun.objects.count() == 0


# --- Workers that die ------------------------------------------------------------------------------


def _worker(**env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "manage.py", "process_webhooks", *env.pop("args", [])],
        cwd=BASE_DIR,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )



@pytest.mark.slow
@postgres_only
@pytest.mark.parametrize("called_a_tool", [True, False], ids=["after-a-tool", "before-any-tool"])
@committed
def test_a_worker_killed_mid_event_loses_its_lease_and_another_worker_takes_over(
    announced_events, settings, called_a_tool
):
    if called_a_tool:
        # The worker dies inside send_email, after the email went out.
        script = [dict(SEND_EMAIL, crash="after_effect"), SAY_DONE]
    else:
        # The worker is killed while it waits on a rate-limited model call: no tool has been called.
        script = [{"fail": "rate_limit", "retry_delay": 3}, LOOKUP, SAY_DONE]
    make_source(script=script)
    event_id = deliver().json()["event_id"]
    env = dict(
        WEBHOOK_ATTACHMENTS_DIR=str(settings.WEBHOOK_ATTACHMENTS_DIR),
        WEBHOOK_LEASE_SECONDS="2",
        RUN_STALE_AFTER_SECONDS="2",
        WEBHOOK_RETRY_DELAYS="1",
    )

    first = _worker(**env)
    if not called_a_tool:
        wait_until(lambda: AgentRun.objects.filter(status=RunStatus.RUNNING).exists(), timeout=60)
        time.sleep(1)
        os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=120)
    assert first.returncode == -signal.SIGKILL

    event = WebhookEvent.objects.get(pk=event_id)
    killed_run = event.runs.get()
    assert (event.status, event.attempts, killed_run.status) == ("processing", 1, "running")
    assert event.lease_expires_at is not None

    second = _worker(args=["--follow", "--max-idle", "8"], **env)
    out, err = second.communicate(timeout=180)
    assert second.returncode == 0, err[-3000:]

    event.refresh_from_db()
    killed_run.refresh_from_db()
    assert (killed_run.status, killed_run.error_code) == (RunStatus.ERROR, "reconciled")
    runs = list(event.runs.order_by("created_at"))
    if called_a_tool:
        assert event.status == EventStatus.NEEDS_REVIEW
        assert killed_run.tools_executed == ["send_email"]
        # It died inside the tool: the call is in doubt until a person settles it.
        assert "call to send_email is in doubt" in event.last_error
        assert len(runs) == 1
        assert OutboxEmail.objects.count() == 1  # never sent twice
    else:
        assert event.status == EventStatus.DONE, event.last_error
        assert killed_run.tools_executed == []
        assert len(runs) == 2
        retry = runs[1]
        assert (retry.status, retry.replay_of_id, retry.tools_executed) == ("success", killed_run.run_id,
                                                                            ["lookup_customer"])
        # Never two runs in flight: the retry started after the killed attempt was settled.
        assert retry.created_at >= killed_run.finished_at
        assert event.attempts == 2


@pytest.mark.slow
@postgres_only
@committed
def test_four_workers_racing_over_the_same_events_start_one_run_each(announced_events, settings):
    make_source()
    ids = [deliver({"n": n}, message_id=f"m-{n}").json()["event_id"] for n in range(12)]
    env = dict(WEBHOOK_ATTACHMENTS_DIR=str(settings.WEBHOOK_ATTACHMENTS_DIR))
    workers = [_worker(**env) for _ in range(4)]
    for worker in workers:
        _, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err[-3000:]
    assert set(WebhookEvent.objects.values_list("status", flat=True)) == {"done"}
    assert AgentRun.objects.count() == 12
    assert sorted(str(e) for e in AgentRun.objects.values_list("webhook_event_id", flat=True)) == sorted(ids)


@committed
def test_a_failure_while_starting_an_attempt_leaves_no_run_and_no_copy(announced_events, settings, monkeypatch):
    make_source()
    event_id = deliver({"attachments": [attachment()]}).json()["event_id"]
    real_set = attempts.update_event

    def failing_set(event, **fields):
        if "attempts" in fields:
            raise RuntimeError("the database went away")
        real_set(event, **fields)

    monkeypatch.setattr(attempts, "update_event", failing_set)
    with pytest.raises(RuntimeError):
        processing.process_event(event_id=event_id)

    assert AgentRun.objects.count() == 0
    inputs = Path(settings.RUN_INPUTS_DIR)
    assert not inputs.exists() or list(inputs.iterdir()) == []
    event = WebhookEvent.objects.get(pk=event_id)
    assert (event.status, event.attempts, event.leased_by) == ("received", 0, "")
    monkeypatch.setattr(attempts, "update_event", real_set)
    assert processing.process_event(event_id=event_id) == EventStatus.DONE
