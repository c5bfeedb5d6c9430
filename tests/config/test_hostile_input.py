"""Hostile input: every door answers 400 with {code, detail} and writes nothing.

Each case here once answered 500 (a RecursionError, a ValueError, PostgreSQL refusing a NUL, a
file name too long for the file system) or stored something that broke later reads. Run on both
databases: several of them only failed on PostgreSQL.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from config.lib import safe_json
from runs.inbox import signing
from runs.models.inbox import WebhookEvent, WebhookSource
from runs.models.ledger import AgentRun
from runs.services import run as services
from tests.factories import make_run
from tests.helpers import SAY_DONE, SEND_EMAIL
from tests.kit import api_as, refused

# Everything here is refused or answered in the request: nothing crosses to another connection.
pytestmark = pytest.mark.django_db

SECRET = "correct-horse-battery-staple-42"
WEBHOOK_URL = "/api/webhooks/inbound-email/"
RUN_FIELDS = b'"agent": "support", "message": "Jane asks about her refund.", "owner_id": "jane"'
DEEP = "[" * 50_000 + "]" * 50_000


@pytest.fixture(autouse=True)
def _no_worker(no_inbox_worker, no_worker, settings, tmp_path):
    settings.WEBHOOK_ATTACHMENTS_DIR = tmp_path / "webhook-attachments"


@pytest.fixture
def token(alice) -> str:
    return Token.objects.create(user=alice).key


@pytest.fixture
def api(token, alice) -> APIClient:
    return api_as(alice)  # with the token above


@pytest.fixture
def source() -> WebhookSource:
    return WebhookSource.objects.create(
        slug="inbound-email", name="Inbound email", agent_name="support", owner_id="jane", secret=SECRET,
        message_id_header="X-Message-Id", expects_attachments=True, params={"script": [SAY_DONE]},
    )


def post_run(api: APIClient, raw: bytes):
    return api.generic("POST", "/api/runs/", raw, content_type="application/json")


def post_chat(token: str, raw: bytes):
    return Client().generic("POST", "/api/chat/", raw, content_type="application/json",
                            HTTP_AUTHORIZATION=f"Token {token}")


def deliver(raw: bytes, *, message_id: str = "msg-1"):
    return Client().generic(
        "POST", WEBHOOK_URL, raw, content_type="application/json",
        headers={"X-Signature": signing.sign_timestamped(SECRET, raw, message_id=message_id),
                 "X-Message-Id": message_id},
    )


def nothing_written() -> None:
    assert AgentRun.objects.count() == 0
    assert WebhookEvent.objects.count() == 0


def _params(fragment: str) -> bytes:
    return b"{" + RUN_FIELDS + b', "params": ' + fragment.encode() + b"}"


# --- POST /api/runs/ (JSON) -------------------------------------------------------------------------

HOSTILE_PARAMS = {
    "nested": '{"x": ' + DEEP + "}",
    "NaN": '{"x": NaN}',
    "Infinity": '{"x": -Infinity}',
    "overflowing float": '{"x": 1e309}',
    "huge integer": '{"x": ' + "9" * 5000 + "}",
    "NUL in a value": '{"x": "a\\u0000b"}',
    "NUL in a key": '{"a\\u0000b": 1}',
    "lone surrogate": '{"x": "\\ud800"}',
    "NUL in tool args": json.dumps({"script": [{"call": "send_email", "args": {"to": "a\u0000@b.c"}}, SAY_DONE]}),
    "lone surrogate in tool args": '{"script": [{"call": "send_email", "args": {"subject": "\\udfff"}}]}',
}


@pytest.mark.parametrize("case", HOSTILE_PARAMS)
def test_hostile_params_to_start_a_run_are_a_400(api, case):
    body = refused(post_run(api, _params(HOSTILE_PARAMS[case])), 400)
    assert body["detail"]
    nothing_written()


@pytest.mark.parametrize(
    "message", ['"hi \\ud800 there"', '"hi \\u0000"'], ids=["lone surrogate", "NUL"]
)
def test_a_hostile_message_is_a_400(api, message):
    raw = b'{"agent": "support", "owner_id": "jane", "message": ' + message.encode() + b"}"
    refused(post_run(api, raw), 400)
    nothing_written()


def test_a_lone_surrogate_never_reaches_the_ledger_so_the_list_keeps_answering(api, alice):
    make_run(created_by=alice, tools=[])
    # DRF's CharField already refuses a surrogate in `message`; in params it used to be stored, and
    # from then on rendering the list failed for everyone.
    refused(post_run(api, _params('{"note": "\\udc00 refund?"}')), 400)
    listing = api.get("/api/runs/")
    assert listing.status_code == 200
    assert len(listing.json()["results"]) == 1


def test_a_deeply_nested_replay_body_is_a_400(api, alice):
    run = make_run(created_by=alice, tools=[])
    refused(api.generic("POST", f"/api/runs/{run.run_id}/replay/", DEEP.encode(), content_type="application/json"), 400)
    assert AgentRun.objects.count() == 1


# --- multipart `params`, uploads and file names ----------------------------------------------------


@pytest.mark.parametrize("case", ["nested", "NaN", "overflowing float", "huge integer", "NUL in a value"])
def test_hostile_params_in_a_multipart_form_are_a_400(api, case):
    form = {"agent": "support", "message": "hi", "owner_id": "jane", "params": HOSTILE_PARAMS[case],
            "file": SimpleUploadedFile("a.txt", b"hello")}
    body = refused(api.post("/api/runs/", form, format="multipart"), 400, code="invalid")
    assert "params" in body["errors"]
    nothing_written()


@pytest.mark.parametrize(
    "name",
    ["a" * 250 + ".pdf", "é" * 150 + ".txt", "報告" * 60 + ".docx"],
    ids=["250 ASCII characters", "300 bytes of accents", "360 bytes of CJK"],
)
def test_a_long_upload_name_is_stored_under_a_name_that_fits_and_kept_whole(api, name):
    response = api.post(
        "/api/runs/", {"agent": "support", "message": "hi", "owner_id": "jane",
                       "file": SimpleUploadedFile(name, b"contents")}, format="multipart",
    )
    assert response.status_code == 202, response.content[:400]
    run = AgentRun.objects.get()
    assert run.input_file_name == name
    stored = Path(run.input_file)
    assert stored.read_bytes() == b"contents"
    assert len(stored.name.encode()) <= 200
    assert stored.suffix == Path(name).suffix


def test_an_upload_name_longer_than_the_cap_is_kept_up_to_the_cap(api):
    response = api.post(
        "/api/runs/", {"agent": "support", "message": "hi", "owner_id": "jane",
                       "file": SimpleUploadedFile("a" * 300 + ".pdf", b"x")}, format="multipart",
    )
    assert response.status_code == 202, response.content[:400]
    run = AgentRun.objects.get()
    # Django's upload handling keeps the last 255 characters with the extension; so does the ledger.
    assert run.input_file_name == "a" * 251 + ".pdf"
    assert Path(run.input_file).read_bytes() == b"x"


def test_a_file_name_over_the_cap_is_refused_by_the_service():
    from io import BytesIO

    with pytest.raises(ValidationError, match="longer than 255"):
        services.start_run(agent_name="support", message="hi", owner_id="jane", file=BytesIO(b"x"),
                           file_name="a" * 300 + ".pdf", enqueue=False)
    nothing_written()


@pytest.mark.parametrize("name", ["invoice\u202efdp.exe", "report\u200b.pdf", "a\u2066b.txt"])
def test_an_input_file_name_with_invisible_formatting_is_refused(api, name):
    from io import BytesIO

    with pytest.raises(ValidationError, match="invisible formatting"):
        services.start_run(agent_name="support", message="hi", owner_id="jane", file=BytesIO(b"x"),
                           file_name=name, enqueue=False)
    nothing_written()
    # Through a multipart upload, Django's parser already drops characters that do not print.
    response = api.post(
        "/api/runs/", {"agent": "support", "message": "hi", "owner_id": "jane",
                       "file": SimpleUploadedFile(name, b"x")}, format="multipart",
    )
    assert response.status_code == 202
    assert AgentRun.objects.get().input_file_name.isprintable()


# --- query strings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["/api/runs/?owner_id=a%00b", "/api/runs/?agent=%00", "/api/runs/?a%00b=1",
     "/api/memory/?agent=support&owner_id=a%00b&q=refund"],
)
def test_a_nul_in_the_query_string_is_a_400(api, url):
    refused(api.get(url), 400, code="invalid_query")


def test_a_nul_in_an_admin_search_is_a_400(admin_client):
    response = admin_client.get("/admin/runs/agentrun/?q=a%00b")
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_query"


# --- POST /api/chat/ ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"agent": "support", "owner_id": "jane", "message": "hi", "params": {"x": ' + DEEP.encode() + b"}}",
        b'{"agent": "support", "owner_id": "jane", "message": "hi", "params": {"x": NaN}}',
        b'{"agent": "support", "owner_id": "jane", "message": "hi", "params": {"x": 1e309}}',
        b'{"agent": "support", "owner_id": "jane", "message": "hi \\ud800"}',
        b'{"agent": "support", "owner_id": "jane", "message": "hi", "params": {"x": "\\u0000"}}',
        (
            b'{"agent": "support", "owner_id": "jane", "message": "hi", "params": {"script": [{"call": "send_email", '
            b'"args": {"to": "\\u0000"}}]}}'
        ),
        DEEP.encode(),
    ],
    ids=["nested params", "NaN", "1e309", "lone surrogate", "NUL", "NUL in tool args", "nested body"],
)
def test_a_hostile_chat_turn_is_a_400_before_any_stream(token, raw):
    body = refused(post_chat(token, raw), 400, code="invalid")
    assert body["detail"]
    nothing_written()


# --- POST /api/webhooks/{source}/ ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"text": ' + DEEP.encode() + b"}",
        b'{"amount": ' + b"7" * 5000 + b"}",
        b'{"amount": NaN}',
        b'{"amount": 1e309}',
        b'{"text": "a\\u0000b"}',
        b'{"te\\u0000xt": "hi"}',
        b'{"text": "\\ud83d"}',
    ],
    ids=["nested", "5000-digit integer", "NaN", "1e309", "NUL", "NUL in a key", "lone surrogate"],
)
def test_a_hostile_webhook_payload_is_a_400_and_nothing_is_stored(source, settings, raw):
    body = refused(deliver(raw), 400, code="malformed_event")
    assert body["detail"]
    nothing_written()
    assert not Path(settings.WEBHOOK_ATTACHMENTS_DIR).exists() or not any(
        Path(settings.WEBHOOK_ATTACHMENTS_DIR).iterdir()
    )


def _attachment(name: str) -> dict:
    return {"filename": name, "content_type": "text/plain", "content_base64": base64.b64encode(b"data").decode()}


@pytest.mark.parametrize("name", ["invoice\u202efdp.exe", "\u202ereadme.txt", "a\u200fb.txt"])
def test_an_attachment_name_with_bidi_controls_is_a_400(source, name):
    body = refused(deliver(json.dumps({"text": "hi", "attachments": [_attachment(name)]}).encode()), 400,
                   code="bad_attachments")
    assert "formatting" in body["detail"]
    nothing_written()


def test_a_long_attachment_name_is_stored_under_a_name_that_fits(source):
    name = "ü" * 200 + ".txt"
    response = deliver(json.dumps({"text": "hi", "attachments": [_attachment(name)]}).encode())
    assert response.status_code == 202, response.content[:400]
    event = WebhookEvent.objects.get()
    stored = event.attachments[0]
    assert stored["filename"] == name
    assert Path(stored["path"]).read_bytes() == b"data"
    assert len(Path(stored["path"]).name.encode()) <= 200


# --- The same rules behind every door --------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [{"x": float("nan")}, {"x": float("inf")}, {"x": "\x00"}, {"x": "\ud800"}, {"\x00": 1}],
    ids=["NaN", "inf", "NUL", "lone surrogate", "NUL key"],
)
def test_start_run_refuses_what_cannot_be_stored_whatever_the_door(params):
    with pytest.raises(ValidationError) as refusal:
        services.start_run(agent_name="support", message="hi", owner_id="jane", params=params, enqueue=False)
    assert "params" in refusal.value.message_dict
    nothing_written()


def test_a_script_nested_within_the_limit_is_accepted(api):
    nested: dict = {"leaf": 1}
    for _ in range(safe_json.MAX_DEPTH - 3):  # with the body and params around it: exactly the limit
        nested = {"n": nested}
    payload = {"agent": "support", "message": "hi", "owner_id": "jane",
               "params": {"script": [SEND_EMAIL, SAY_DONE], "context": nested}}
    response = api.post("/api/runs/", payload, format="json")
    assert response.status_code == 202, response.content[:400]


def test_the_strict_reader_names_what_it_refuses():
    for text, words in [
        ("[" * 40 + "]" * 40, "nested more than 32"),
        ('{"a": NaN}', "NaN"),
        ("1e400", "overflows"),
        ("1" * 100, "longer than 64"),
        ('["\\u0000"]', "NUL"),
        ('{"k": "\\udc80"}', "lone surrogate"),
        ('{"a": ', "not valid JSON"),
    ]:
        with pytest.raises(safe_json.UnsafeInput, match=words):
            safe_json.loads(text)
    # Brackets inside strings are text, not nesting.
    assert safe_json.loads('{"s": "' + "[" * 100 + '"}') == {"s": "[" * 100}
