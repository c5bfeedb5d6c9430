"""Receipt: a delivery is verified, its attachments copied and its event row written before the provider hears 202.

The same provider message id again answers with the first event (the unique constraint decides races).
A new id needs a new signature: both schemes sign the id (runs.inbox.signing).

Until a delivery is verified its caller is nobody: an unknown or disabled source, a missing,
malformed or wrong signature, and a message id that cannot be read to check the signature all get
one answer (`NotAccepted`, 404), and a delivery to a source that does not exist is checked
against a stand-in source with a random secret, so that the answer's time does not tell either.
The reason is logged for the operator.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import logging
import os
import secrets
import shutil
import unicodedata
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from config.lib import crypto, files, safe_json
from runs.inbox import signing
from runs.inbox.refusals import BadAttachments, BodyTooLarge, MalformedEvent, MessageIdMissing, NotAccepted
from runs.inputs import run_input
from runs.inputs.sources import SignatureScheme
from runs.ledger import wakeup
from runs.models.inbox import WebhookEvent, WebhookSource

logger = logging.getLogger(__name__)

MAX_EXTERNAL_ID_CHARS = 255
MAX_ATTACHMENTS = 20
# Headers worth keeping beside the payload (the signature is not one of them: it proves
# nothing once verified, and the payload is what the agent acts on).
KEPT_HEADERS = ("Content-Type", "User-Agent", "X-Request-Id", "X-Delivery-Id")


# --- Receipt ---------------------------------------------------------------------------------------


def find_source(slug: str) -> WebhookSource | None:
    """The enabled source of this slug, or None (which the receipt answers as it answers a bad signature)."""
    return WebhookSource.objects.filter(slug=slug, enabled=True).first()


@functools.lru_cache(maxsize=4)
def _stand_in_ciphertext(keys: tuple[str, ...]) -> str:
    return crypto.encrypt(secrets.token_hex(32))


def _stand_in_source() -> WebhookSource:
    """A source nobody can sign for, the default kind, its secret decrypted as a stored one is."""
    secret = crypto.decrypt(_stand_in_ciphertext(tuple(settings.SECRETS_ENCRYPTION_KEYS)))
    return WebhookSource(slug="", name="", message_id_header="X-Message-Id", secret=secret)


@dataclass(frozen=True)
class Attachment:
    filename: str
    content_type: str
    data: bytes


def _header_message_id(source: WebhookSource, headers: Mapping[str, str]) -> str:
    return _checked_message_id(headers.get(source.message_id_header), f"header {source.message_id_header}")


def _field_message_id(source: WebhookSource, payload: dict) -> str:
    value: Any = payload
    for part in source.message_id_field.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            value = None
            break
    return _checked_message_id(value, f"JSON field {source.message_id_field}")


def _checked_message_id(value: Any, where: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise MessageIdMissing(
            f"The provider's message id was not found in the {where}: every event needs one, so that a "
            "repeated delivery is recognised.",
        )
    value = value.strip()
    if len(value) > MAX_EXTERNAL_ID_CHARS:
        raise MessageIdMissing(f"The message id in the {where} is longer than {MAX_EXTERNAL_ID_CHARS} characters.")
    if any(unicodedata.category(ch) == "Cc" for ch in value):
        raise MessageIdMissing(f"The message id in the {where} contains control characters.")
    return value


def _payload(body: bytes) -> dict:
    try:
        payload = safe_json.loads(body)
    except safe_json.UnsafeInput as exc:
        raise MalformedEvent(f"The body is not a JSON event this inbox can store: {exc}") from None
    if not isinstance(payload, dict):
        raise MalformedEvent("The body must be a JSON object.")
    return payload


def _verified(source: WebhookSource, body: bytes, headers: Mapping[str, str]) -> tuple[dict, str]:
    """The payload and the message id of a delivery whose signature matched.

    Raises signing.Unverified until the signature matched (a message id that cannot be read is
    one reason); after that, the refusals an authenticated provider may read (MalformedEvent,
    MessageIdMissing, SignatureExpired).
    """
    signature = signing.read_signature(source, headers.get(signing.SIGNATURE_HEADER))
    if source.message_id_header:
        external_id = _unverified_unless(lambda: _header_message_id(source, headers))
        signing.verify_signature(source, signature, body, message_id=external_id)
        return _payload(body), external_id
    if source.signature_scheme == SignatureScheme.BODY:
        signing.verify_signature(source, signature, body, message_id=None)
        payload = _payload(body)
        return payload, _field_message_id(source, payload)
    # The id this scheme signs is inside the body, so the body is parsed (strictly, within its
    # bound) before the signature is checked; until it matched, a body that is not JSON or has
    # no id is one more unverified delivery.
    payload = _unverified_unless(lambda: _payload(body))
    external_id = _unverified_unless(lambda: _field_message_id(source, payload))
    signing.verify_signature(source, signature, body, message_id=external_id)
    return payload, external_id


def _unverified_unless(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except (MalformedEvent, MessageIdMissing) as refusal:
        raise signing.Unverified(f"the message id the signature covers cannot be read: {refusal.detail}") from None


def _authenticated(
    slug: str, source: WebhookSource | None, body: bytes, headers: Mapping[str, str]
) -> tuple[WebhookSource, dict, str]:
    try:
        payload, external_id = _verified(source or _stand_in_source(), body, headers)
    except signing.Unverified as unverified:
        reason = "no enabled source has this slug" if source is None else unverified.reason
        logger.warning("Webhook delivery to %r not accepted: %s", slug[:100], reason)
        raise NotAccepted() from None
    if source is None:  # a stand-in cannot be signed for; this is never reached
        raise NotAccepted()
    return source, payload, external_id


def _attachments(source: WebhookSource, payload: dict) -> tuple[list[Attachment], dict]:
    """Decode `attachments` and return them with the payload that keeps only their descriptions."""
    raw = payload.get("attachments")
    if raw is None:
        return [], payload
    if not source.expects_attachments:
        raise BadAttachments(
            f"The source “{source.slug}” does not take attachments, but the event has an “attachments” field."
        )
    if not isinstance(raw, list):
        raise BadAttachments("“attachments” must be a list of {filename, content_type, content_base64} objects.")
    if len(raw) > MAX_ATTACHMENTS:
        raise BadAttachments(f"The event has {len(raw)} attachments; at most {MAX_ATTACHMENTS} are accepted.")
    decoded: list[Attachment] = []
    seen: set[str] = set()
    for index, item in enumerate(raw, start=1):
        where = f"Attachment {index}"
        if not isinstance(item, dict):
            raise BadAttachments(f"{where} must be an object with filename, content_type and content_base64.")
        try:
            filename = run_input.clean_file_name(item.get("filename"))
        except ValidationError as exc:
            raise BadAttachments(f"{where}: {' '.join(exc.message_dict['file'])}") from None
        if filename.lower() in seen:
            raise BadAttachments(f"{where}: the file name {filename!r} is used twice in this event.")
        seen.add(filename.lower())
        content_type = item.get("content_type") or "application/octet-stream"
        if not isinstance(content_type, str) or len(content_type) > 255:
            raise BadAttachments(f"{where} ({filename}): content_type must be a short string.")
        encoded = item.get("content_base64")
        if not isinstance(encoded, str):
            raise BadAttachments(f"{where} ({filename}): content_base64 is missing or not a string.")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise BadAttachments(f"{where} ({filename}): content_base64 is not valid base64.") from None
        if len(data) > settings.MAX_UPLOAD_BYTES:
            raise BodyTooLarge(
                f"{where} ({filename}) is {len(data)} bytes; a run's input file may be at most "
                f"{settings.MAX_UPLOAD_BYTES} bytes (MAX_UPLOAD_BYTES)."
            )
        decoded.append(Attachment(filename, content_type, data))
    described = [{"filename": a.filename, "content_type": a.content_type, "size": len(a.data)} for a in decoded]
    return decoded, {**payload, "attachments": described}


def attachments_dir(event_id: uuid.UUID) -> Path:
    return Path(settings.WEBHOOK_ATTACHMENTS_DIR) / str(event_id)


def _store_attachments(event_id: uuid.UUID, attachments: list[Attachment]) -> list[dict]:
    """Write each file (fsynced, then renamed into place) and return what the row records."""
    if not attachments:
        return []
    directory = attachments_dir(event_id)
    files.make_private_dir(directory, exist_ok=False)
    stored = []
    for attachment in attachments:
        destination = directory / files.disk_name(attachment.filename)
        partial = destination.with_name(destination.name + ".partial")
        with files.open_private(partial) as out:
            out.write(attachment.data)
            out.flush()
            os.fsync(out.fileno())
        partial.rename(destination)
        stored.append(
            {
                "filename": attachment.filename,
                "content_type": attachment.content_type,
                "size": len(attachment.data),
                "sha256": hashlib.sha256(attachment.data).hexdigest(),
                "path": str(destination),
            }
        )
    return stored


def _kept_headers(source: WebhookSource, headers: Mapping[str, str]) -> dict[str, str]:
    names = [*KEPT_HEADERS, *([source.message_id_header] if source.message_id_header else [])]
    return {name: str(headers[name])[:1000] for name in names if headers.get(name) is not None}


def event_message(source: WebhookSource, external_id: str, payload: dict) -> str:
    """The run's message: the source's instructions, then the event as JSON."""
    head = source.instructions.strip() or f"Handle this event from {source.name}."
    body = json.dumps(payload, ensure_ascii=False, indent=2, sort_keys=True)
    text = f"{head}\n\nWebhook event {external_id} from {source.name}:\n{body}"
    files = payload.get("attachments") if source.expects_attachments else None
    if files:
        text += f"\n\nThe first attachment ({files[0]['filename']}) is attached to this message."
    return text


@dataclass(frozen=True)
class Receipt:
    event: WebhookEvent
    created: bool


def receive_event(*, slug: str, body: bytes, headers: Mapping[str, str]) -> Receipt:
    """Verify, parse, store (attachments first, then the row) and enqueue one delivery to `slug`.

    Raises a WebhookRefused for a delivery that is not stored (NotAccepted for every one not
    authenticated). Returns the first event (created False) when the provider's message id was
    already received from this source.
    """
    if len(body) > settings.WEBHOOK_MAX_BYTES:
        raise BodyTooLarge()
    source, payload, external_id = _authenticated(slug, find_source(slug), body, headers)

    existing = WebhookEvent.objects.filter(source=source, external_id=external_id).first()
    if existing is not None:
        return Receipt(existing, created=False)

    attachments, stored_payload = _attachments(source, payload)
    message = event_message(source, external_id, stored_payload)
    if len(message) > settings.MAX_MESSAGE_CHARS:
        raise BodyTooLarge(
            f"The event (without its attachments) makes a message of {len(message)} characters; the agent "
            f"takes at most {settings.MAX_MESSAGE_CHARS} (MAX_MESSAGE_CHARS)."
        )

    event_id = uuid.uuid4()
    now = timezone.now()
    try:
        stored = _store_attachments(event_id, attachments)
        with transaction.atomic():
            event = WebhookEvent.objects.create(
                event_id=event_id,
                source=source,
                external_id=external_id,
                payload=stored_payload,
                headers=_kept_headers(source, headers),
                attachments=stored,
                received_at=now,
                next_attempt_at=now,
            )
            # Wakes the workers at the commit; a worker's poll finds the event anyway.
            announce_event(event_id)
    except IntegrityError:
        shutil.rmtree(attachments_dir(event_id), ignore_errors=True)
        existing = WebhookEvent.objects.filter(source=source, external_id=external_id).first()
        if existing is None:
            raise
        return Receipt(existing, created=False)
    except BaseException:
        shutil.rmtree(attachments_dir(event_id), ignore_errors=True)
        raise
    logger.info("Webhook event %s stored (source %s, message id %s)", event_id, source.slug, external_id)
    return Receipt(event, created=True)


def announce_event(event_id: uuid.UUID) -> None:
    """Event `event_id` became claimable: wake the workers at this transaction's commit (runs.ledger.wakeup)."""
    wakeup.notify(wakeup.INBOX_CHANNEL)
