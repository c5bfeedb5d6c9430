"""Webhook signatures that cannot be replayed: the timestamped scheme, the body-only scheme, and their rules.

Every delivery goes through the real door (`POST /api/webhooks/<slug>/`) and every accepted one
through the real processing path (its event processed by a run).
"""

from __future__ import annotations

import json
import logging
import re
import time

import pytest
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import IntegrityError, connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.test import Client

from runs.inbox import processing, signing
from runs.inbox.refusals import NotAccepted
from runs.inputs.sources import SignatureScheme
from runs.models.inbox import EventStatus, WebhookEvent, WebhookSource
from runs.models.ledger import AgentRun
from tests.helpers import LOOKUP, SAY_DONE, read_settings
from tests.inbox.test_webhook_desk import source_form
from tests.kit import refused

pytestmark = pytest.mark.django_db

# The event is processed by a run on the agent loop: its thread and ADK's engine read what the test committed.
processed_by_a_run = pytest.mark.django_db(transaction=True)

SECRET = "correct-horse-battery-staple-42"
OLD_SECRET = "the-secret-being-rotated-out-7"
HEADER_URL = "/api/webhooks/by-header/"
FIELD_URL = "/api/webhooks/by-field/"
BODY_URL = "/api/webhooks/body-only/"


@pytest.fixture(autouse=True)
def _inbox(settings, tmp_path, monkeypatch):
    settings.WEBHOOK_ATTACHMENTS_DIR = tmp_path / "webhook-attachments"
    settings.WEBHOOK_SIGNATURE_TOLERANCE_SECONDS = 300


def make_source(slug: str, **fields) -> WebhookSource:
    values = dict(slug=slug, name=slug, agent_name="support", owner_id="jane", secret=SECRET,
                  params={"script": [LOOKUP, SAY_DONE]})
    values.update(fields)
    return WebhookSource.objects.create(**values)


@pytest.fixture
def by_header():
    return make_source("by-header", message_id_header="X-Message-Id")


@pytest.fixture
def by_field():
    return make_source("by-field", message_id_field="message.id")


@pytest.fixture
def body_only():
    return make_source("body-only", message_id_field="message.id", signature_scheme=SignatureScheme.BODY)


def post(url: str, body: bytes, signature: str | None, **headers):
    sent = dict(headers)
    if signature is not None:
        sent["X-Signature"] = signature
    return Client().post(url, data=body, content_type="application/json", headers=sent)


def event_body(message_id: str = "msg-1", text: str = "Where is my refund?") -> bytes:
    return json.dumps({"message": {"id": message_id}, "from": "jane@example.com", "text": text}).encode()


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.WARNING, logger="runs.inbox.receipt")
    return caplog


def not_accepted(response, log, *reasons: str) -> None:
    """The one answer to an unauthenticated delivery: nothing about the source or its scheme; the
    reason only in the operator's log."""
    assert response.status_code == 404, response.content
    assert response.json() == {"code": "not_accepted", "detail": NotAccepted().detail}
    for reason in reasons:
        assert reason in log.text, log.text


def process_all() -> int:
    return processing.process_due()


def nothing_stored() -> None:
    assert WebhookEvent.objects.count() == 0
    assert AgentRun.objects.count() == 0


# --- The replay finding -----------------------------------------------------------------------------


@processed_by_a_run
def test_a_timestamped_delivery_resent_under_a_new_header_id_is_refused_and_starts_nothing(by_header, announced_events, log):
    body = event_body()
    signature = signing.sign_timestamped(SECRET, body, message_id="msg-1")
    first = post(HEADER_URL, body, signature, **{"X-Message-Id": "msg-1"})
    assert first.status_code == 202, first.content
    assert process_all() == 1
    assert WebhookEvent.objects.get().status == EventStatus.DONE

    replayed = post(HEADER_URL, body, signature, **{"X-Message-Id": "msg-2"})

    not_accepted(replayed, log, "no digest matches")
    assert process_all() == 0
    assert WebhookEvent.objects.count() == 1
    assert AgentRun.objects.count() == 1
    assert len(announced_events) == 1

    # The same signed delivery re-sent as it was is the provider retrying: the first event, no new run.
    again = post(HEADER_URL, body, signature, **{"X-Message-Id": "msg-1"})
    assert again.status_code == 200
    assert again.json() == {"event_id": first.json()["event_id"], "status": "done", "duplicate": True}
    assert process_all() == 0
    assert (WebhookEvent.objects.count(), AgentRun.objects.count()) == (1, 1)


@processed_by_a_run
def test_a_timestamped_delivery_whose_body_field_id_is_changed_is_refused(by_field, announced_events, log):
    body = event_body("msg-1")
    signature = signing.sign_timestamped(SECRET, body, message_id="msg-1")
    assert post(FIELD_URL, body, signature).status_code == 202
    assert process_all() == 1

    not_accepted(post(FIELD_URL, event_body("msg-2"), signature), log, "no digest matches")
    # Signed for the old id, sent with the new one (the id is signed apart from the body too).
    renamed = event_body("msg-2")
    not_accepted(post(FIELD_URL, renamed, signing.sign_timestamped(SECRET, renamed, message_id="msg-1")), log)
    assert process_all() == 0
    assert (WebhookEvent.objects.count(), AgentRun.objects.count()) == (1, 1)


@processed_by_a_run
def test_a_body_signed_delivery_cannot_be_resent_under_a_new_id(body_only, announced_events, log):
    body = event_body("msg-1")
    signature = signing.sign_body(SECRET, body)
    first = post(BODY_URL, body, signature, **{"X-Message-Id": "msg-1"})
    assert first.status_code == 202, first.content
    assert process_all() == 1

    # The id is the body's: a new one means a new body, which the old signature does not cover.
    not_accepted(post(BODY_URL, event_body("msg-2"), signature), log, "no digest matches")
    # A header is never this source's id: the same signed body under a new X-Message-Id is the
    # same event again.
    again = post(BODY_URL, body, signature, **{"X-Message-Id": "msg-2"})
    assert again.status_code == 200
    assert again.json()["event_id"] == first.json()["event_id"] and again.json()["duplicate"] is True
    assert process_all() == 0
    assert (WebhookEvent.objects.count(), AgentRun.objects.count()) == (1, 1)
    assert len(announced_events) == 1


# --- The timestamped scheme -------------------------------------------------------------------------


@processed_by_a_run
def test_a_timestamped_delivery_is_accepted_and_processed_by_a_run(by_header, announced_events):
    body = event_body()
    response = post(HEADER_URL, body, signing.sign_timestamped(SECRET, body, message_id="m-7"),
                    **{"X-Message-Id": "m-7"})
    assert response.status_code == 202, response.content
    event = WebhookEvent.objects.get(pk=response.json()["event_id"])
    assert event.external_id == "m-7"
    assert "X-Signature" not in event.headers
    assert processing.process_event(event_id=event.pk) == EventStatus.DONE
    assert event.runs.get().status == "success"


def test_a_body_field_id_is_signed_as_the_inbox_reads_it(by_field, announced_events):
    # A numeric id is signed in its decimal form.
    body = json.dumps({"message": {"id": 981}, "text": "hi"}).encode()
    response = post(FIELD_URL, body, signing.sign_timestamped(SECRET, body, message_id="981"))
    assert response.status_code == 202, response.content
    assert WebhookEvent.objects.get().external_id == "981"


@processed_by_a_run
@pytest.mark.parametrize(
    "offset, accepted, direction",
    [
        (-290, True, ""),
        (280, True, ""),
        (-302, False, "old"),
        (-86_400, False, "old"),
        (310, False, "ahead of this server's clock"),
    ],
)
def test_the_timestamp_must_be_within_the_window_both_ways(by_header, announced_events, offset, accepted, direction):
    body = event_body()
    timestamp = int(time.time()) + offset
    signature = signing.sign_timestamped(SECRET, body, message_id="m-1", timestamp=timestamp)
    response = post(HEADER_URL, body, signature, **{"X-Message-Id": "m-1"})
    if accepted:
        assert response.status_code == 202, response.content
        assert process_all() == 1
        return
    answer = refused(response, 401, "signature_expired", f"t={timestamp}", "within 300 seconds",
                     "WEBHOOK_SIGNATURE_TOLERANCE_SECONDS", "clock")
    skew = re.search(r"is (\d+) seconds (.+?);", answer["detail"])
    assert skew is not None and skew.group(2) == direction, answer["detail"]
    assert abs(int(skew.group(1)) - abs(offset)) <= 1  # the second that may pass between signing and checking
    assert (answer["timestamp"], answer["tolerance_seconds"]) == (timestamp, 300)
    nothing_stored()
    assert announced_events == []


def test_the_window_is_the_setting(by_header, announced_events, settings):
    settings.WEBHOOK_SIGNATURE_TOLERANCE_SECONDS = 10
    body = event_body()
    signature = signing.sign_timestamped(SECRET, body, message_id="m-1", timestamp=int(time.time()) - 60)
    refused(post(HEADER_URL, body, signature, **{"X-Message-Id": "m-1"}), 401, "signature_expired", "within 10 seconds")
    nothing_stored()


def test_an_old_timestamp_with_a_wrong_digest_is_not_accepted_and_says_nothing_of_the_clock(by_header, announced_events, log):
    body = event_body()
    old = int(time.time()) - 3600
    forged = signing.sign_timestamped("not-the-secret-at-all-0000", body, message_id="m-1", timestamp=old)
    not_accepted(post(HEADER_URL, body, forged, **{"X-Message-Id": "m-1"}), log, "no digest matches")
    nothing_stored()


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("no t", "has no timestamp (t=…)"),
        ("two t", "more than one timestamp"),
        ("t not a number", "not a whole number of unix seconds"),
        ("negative t", "not a whole number of unix seconds"),
        ("no v1", "has no digest (v1=…)"),
        ("short digest", "not 64 hexadecimal digits"),
        ("not hex", "not 64 hexadecimal digits"),
        ("no key=value", "is not key=value"),
        ("body-only form", "body-only signature (sha256=…)"),
        ("wrong secret", "no digest matches"),
        ("other message id", "no digest matches"),
        ("other timestamp", "no digest matches"),
    ],
)
def test_a_bad_timestamped_signature_is_not_accepted_and_stores_nothing(by_header, announced_events, log, case, fragment):
    body = event_body()
    now = int(time.time())
    good = signing.sign_timestamped(SECRET, body, message_id="m-1", timestamp=now)
    digest = good.split("v1=")[1]
    signature = {
        "no t": f"v1={digest}",
        "two t": f"t={now},t={now},v1={digest}",
        "t not a number": f"t=soon,v1={digest}",
        "negative t": f"t=-{now},v1={digest}",
        "no v1": f"t={now}",
        "short digest": f"t={now},v1={digest[:63]}",
        "not hex": f"t={now},v1={'z' * 64}",
        "no key=value": f"t={now},{digest}",
        "body-only form": signing.sign_body(SECRET, body),
        "wrong secret": signing.sign_timestamped("not-the-secret-at-all-0000", body, message_id="m-1"),
        "other message id": signing.sign_timestamped(SECRET, body, message_id="m-2", timestamp=now),
        "other timestamp": f"t={now - 1},v1={digest}",
    }[case]
    response = post(HEADER_URL, body, signature, **{"X-Message-Id": "m-1"})
    not_accepted(response, log, fragment)
    assert SECRET not in log.text
    nothing_stored()
    assert announced_events == []


def test_a_missing_signature_is_not_accepted(by_header, body_only, announced_events, log):
    body = event_body()
    not_accepted(post(HEADER_URL, body, None, **{"X-Message-Id": "m-1"}), log, "no X-Signature header")
    not_accepted(post(BODY_URL, body, "   "), log, "no X-Signature header")
    nothing_stored()


@processed_by_a_run
def test_several_digests_are_accepted_when_one_is_right(by_header, announced_events, log):
    body = event_body()
    rotating = signing.sign_timestamped([OLD_SECRET, SECRET], body, message_id="m-1")
    assert rotating.count("v1=") == 2
    assert post(HEADER_URL, body, rotating, **{"X-Message-Id": "m-1"}).status_code == 202

    both_wrong = signing.sign_timestamped([OLD_SECRET, "another-wrong-secret-000"], body, message_id="m-2")
    not_accepted(post(HEADER_URL, body, both_wrong, **{"X-Message-Id": "m-2"}), log, "no digest matches")
    assert process_all() == 1
    assert (WebhookEvent.objects.count(), AgentRun.objects.count()) == (1, 1)


@processed_by_a_run
def test_uppercase_hex_and_surrounding_whitespace_are_accepted(by_header, body_only, announced_events):
    body = event_body("m-1")
    t, v1 = signing.sign_timestamped(SECRET, body, message_id="m-1").split(",")
    spaced = f"  {t} ,  v1={v1.removeprefix('v1=').upper()}  , "
    assert post(HEADER_URL, body, spaced, **{"X-Message-Id": "m-1"}).status_code == 202

    shouted = "SHA256=" + signing.sign_body(SECRET, body).removeprefix("sha256=").upper()
    assert post(BODY_URL, body, f" {shouted}\t").status_code == 202
    assert process_all() == 2
    assert AgentRun.objects.count() == 2


# --- The body-only scheme ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("no prefix", "does not start with “sha256=”"),
        ("timestamped form", "does not start with “sha256=”"),
        ("short digest", "not 64 hexadecimal digits"),
        ("wrong secret", "no digest matches"),
    ],
)
def test_a_bad_body_signature_is_not_accepted_and_stores_nothing(body_only, announced_events, log, case, fragment):
    body = event_body()
    good = signing.sign_body(SECRET, body)
    signature = {
        "no prefix": good.removeprefix("sha256="),
        "timestamped form": signing.sign_timestamped(SECRET, body, message_id="msg-1"),
        "short digest": good[:-1],
        "wrong secret": signing.sign_body("not-the-secret-at-all-0000", body),
    }[case]
    not_accepted(post(BODY_URL, body, signature), log, fragment)
    nothing_stored()


def test_a_body_only_source_with_a_header_id_is_refused_by_validation():
    source = WebhookSource(slug="s", name="S", agent_name="support", owner_id="jane", secret=SECRET,
                           message_id_header="X-Message-Id", signature_scheme=SignatureScheme.BODY)
    with pytest.raises(ValidationError) as refusal:
        source.full_clean()
    assert "does not cover the message id header" in " ".join(refusal.value.message_dict["signature_scheme"])

    source.signature_scheme = "md5"
    with pytest.raises(ValidationError) as refusal:
        source.full_clean()
    assert "“timestamped” or “body”" in " ".join(refusal.value.message_dict["signature_scheme"])

    source.signature_scheme = SignatureScheme.TIMESTAMPED
    source.full_clean()


def test_a_body_only_source_with_a_header_id_is_refused_by_the_database(body_only, by_header):
    with pytest.raises(IntegrityError), transaction.atomic():
        make_source("s", message_id_header="X-Message-Id", signature_scheme=SignatureScheme.BODY)
    with pytest.raises(IntegrityError), transaction.atomic():
        WebhookSource.objects.filter(pk=by_header.pk).update(signature_scheme=SignatureScheme.BODY)
    with pytest.raises(IntegrityError), transaction.atomic():
        WebhookSource.objects.filter(pk=body_only.pk).update(message_id_header="X-Message-Id", message_id_field="")
    with pytest.raises(IntegrityError), transaction.atomic():
        WebhookSource.objects.filter(pk=body_only.pk).update(signature_scheme="md5")
    assert sorted(WebhookSource.objects.values_list("slug", "signature_scheme")) == [
        ("body-only", "body"), ("by-header", "timestamped"),
    ]


def test_new_sources_are_timestamped():
    assert make_source("new", message_id_field="id").signature_scheme == SignatureScheme.TIMESTAMPED


def test_the_admin_shows_and_validates_the_scheme(admin_client):
    refused_form = admin_client.post(
        "/admin/runs/webhooksource/add/",
        source_form(signature_scheme="body", message_id_header="X-Id", message_id_field=""),
    )
    assert refused_form.status_code == 200
    errors = refused_form.context["adminform"].form.errors
    assert "does not cover the message id header" in " ".join(errors["signature_scheme"]), errors
    assert not WebhookSource.objects.exists()

    created = admin_client.post("/admin/runs/webhooksource/add/", source_form(signature_scheme="body"), follow=True)
    assert created.status_code == 200
    source = WebhookSource.objects.get(slug="forms")
    assert source.signature_scheme == "body"
    page = admin_client.get(f"/admin/runs/webhooksource/{source.pk}/change/").content.decode()
    assert 'name="signature_scheme"' in page and "body only" in page
    assert "column-signature_scheme" in admin_client.get("/admin/runs/webhooksource/").content.decode()


# --- Upgrading --------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)  # migrating back and forth changes the schema: no test transaction around it
def test_the_migration_keeps_body_field_sources_on_body_and_moves_header_sources_to_timestamped():
    before, after = [("runs", "0009_owner_rule")], [("runs", "0010_webhook_signature_scheme")]
    executor = MigrationExecutor(connection)
    leaves = executor.loader.graph.leaf_nodes()
    try:
        executor.migrate(before)
        old = executor.loader.project_state(before).apps.get_model("runs", "WebhookSource")
        for slug, header, field in (("by-header", "X-Message-Id", ""), ("by-field", "", "message.id")):
            old.objects.create(slug=slug, name=slug, agent_name="support", owner_id="jane", secret=SECRET,
                               message_id_header=header, message_id_field=field)
        executor = MigrationExecutor(connection)
        executor.migrate(after)
    finally:
        MigrationExecutor(connection).migrate(leaves)
    assert dict(WebhookSource.objects.values_list("slug", "signature_scheme")) == {
        "by-header": "timestamped", "by-field": "body",
    }


@pytest.mark.parametrize(
    "value, words",
    [
        ("0", "WEBHOOK_SIGNATURE_TOLERANCE_SECONDS=0 is too small: it must be at least 1"),
        ("five minutes", "WEBHOOK_SIGNATURE_TOLERANCE_SECONDS='five minutes' is not a whole number"),
    ],
)
def test_a_bad_tolerance_stops_start_up_naming_the_variable(value, words):
    with pytest.raises(ImproperlyConfigured) as refused:
        read_settings(WEBHOOK_SIGNATURE_TOLERANCE_SECONDS=value)
    assert words in str(refused.value)


# --- One answer for every unauthenticated delivery --------------------------------------------------


def test_an_unknown_source_and_a_badly_signed_delivery_hear_the_same_bytes(by_header, by_field, body_only, announced_events, log):
    WebhookSource.objects.create(slug="switched-off", name="Off", agent_name="support", owner_id="jane", secret=SECRET,
                                 message_id_header="X-Message-Id", enabled=False)
    body = event_body()
    forged = signing.sign_timestamped("not-the-secret-at-all-0000", body, message_id="msg-1")
    answers = {
        "unknown source": post("/api/webhooks/nobody/", body, forged, **{"X-Message-Id": "msg-1"}),
        "unknown source, unsigned": post("/api/webhooks/nobody/", b"not json", None),
        "disabled source": post("/api/webhooks/switched-off/", body, forged, **{"X-Message-Id": "msg-1"}),
        "wrong secret": post(HEADER_URL, body, forged, **{"X-Message-Id": "msg-1"}),
        "no signature": post(HEADER_URL, body, None, **{"X-Message-Id": "msg-1"}),
        "no message id": post(HEADER_URL, body, forged),
        "body-only form on a timestamped source": post(HEADER_URL, body, signing.sign_body(SECRET, body),
                                                       **{"X-Message-Id": "msg-1"}),
        # The body field id is read before the signature can be checked: unsigned, nobody hears why.
        "field source, not JSON": post(FIELD_URL, b"{not json", forged),
        "field source, no id": post(FIELD_URL, b'{"text": "hi"}', forged),
        "body source, wrong secret": post(BODY_URL, body, signing.sign_body("not-the-secret-at-all-0000", body)),
    }
    seen = {(response.status_code, response.content) for response in answers.values()}
    assert len(seen) == 1, {case: (r.status_code, r.content) for case, r in answers.items()}
    status, content = seen.pop()
    assert status == 404
    text = content.decode()
    for hint in ("t=", "v1=", "sha256", "HMAC", "X-Message-Id", "message.id", "timestamp", "nobody", "by-header"):
        assert hint not in text, hint
    assert "www-authenticate" not in {name.lower() for name in answers["wrong secret"].headers}
    assert "no enabled source has this slug" in log.text
    nothing_stored()


def test_an_unknown_source_is_checked_against_a_stand_in_secret(by_header, announced_events, monkeypatch):
    checked = []
    real = signing.verify_signature

    def spy(source, signature, body, *, message_id):
        checked.append((source.pk, source.secret))
        return real(source, signature, body, message_id=message_id)

    monkeypatch.setattr(signing, "verify_signature", spy)
    body = event_body()
    signature = signing.sign_timestamped(SECRET, body, message_id="msg-1")
    assert post("/api/webhooks/nobody/", body, signature, **{"X-Message-Id": "msg-1"}).status_code == 404
    assert post(HEADER_URL, body, signature, **{"X-Message-Id": "msg-1"}).status_code == 202
    (stand_in_pk, stand_in_secret), (real_pk, real_secret) = checked
    # The same work for both: an HMAC over the body with a secret of its own, never a real source's.
    assert stand_in_pk is None and real_pk == by_header.pk
    assert len(stand_in_secret) >= 32 and stand_in_secret != real_secret
