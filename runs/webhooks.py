"""The durable webhook inbox: events stored once, processed by runs, retried only when harmless.

Receipt (`receive_event`): the signature is checked on the raw body, the attachments are copied
to disk and the event row is written *before* the provider hears 202; the same provider
message id again answers with the first event (the unique constraint decides races).

Processing (`process_event`, `claim_next`): a worker leases the event (`SELECT … FOR UPDATE SKIP
LOCKED` on PostgreSQL; on SQLite a conditional UPDATE inside an IMMEDIATE transaction, which
serialises writers) and, under that row lock, judges the event's last run:

* no run yet → start one (trigger `webhook`) and execute it in this worker;
* a run still queued → execute it (its claim is atomic, so it runs once);
* a run still running with a live heartbeat → leave it alone and look again when the lease ends;
  a run whose heartbeat went silent is reconciled first, then judged as the failure it is;
* a success → the event is `done`;
* a failure → `runs.replay.decide(run, force=False)`: if the run provably called no tool the
  event waits for its next retry (`retry_wait`, backing off) or, past WEBHOOK_MAX_ATTEMPTS, is
  `dead`; otherwise it `needs_review`, saying what was called, and waits for a person.

A new run is only ever started under the event's row lock after its previous run has settled,
and a partial unique index on `agent_runs(webhook_event)` for queued/running rows makes "two
runs in flight for one event" impossible even for a path that forgot the rules.

The worker that executes a run observes its outcome itself right after; a worker that dies
mid-event stops renewing its lease, and whoever claims the expired lease (a worker polling for
due events, or a task the sweeper enqueued) settles the event from the run's outcome. Every
transition is conditional on the event's state under its row lock, so doing it twice is harmless.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import os
import shutil
import threading
import unicodedata
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, close_old_connections, connection, transaction
from django.db.models import Q
from django.utils import timezone

from agents.registry import UnknownAgentError, get_agent_spec, validate_params
from agents.scripted import ScriptError
from config.lib import files, safe_json
from runs import services
from runs.models import AgentRun, EventStatus, RunStatus, Trigger, WebhookEvent, WebhookSource
from runs.refusals import ForceNotPermitted, ReasonRequired, ReasonTooLong, Refusal

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Signature"
SIGNATURE_PREFIX = "sha256="
MAX_EXTERNAL_ID_CHARS = 255
MAX_ATTACHMENTS = 20
MIN_SECRET_CHARS = 16
# Headers worth keeping beside the payload (the signature is not one of them: it proves
# nothing once verified, and the payload is what the agent acts on).
KEPT_HEADERS = ("Content-Type", "User-Agent", "X-Request-Id", "X-Delivery-Id")

EVENT_FORCE_HINT = "Use “Force reprocess…” to process it again anyway."
REVIEW_HINT = "A person must decide: “Force reprocess…” to process it again anyway, or “Mark resolved”."


# --- Refusals --------------------------------------------------------------------------------------


class WebhookRefused(Refusal):
    """A delivery the inbox will not store; nothing was written."""


class UnknownSource(WebhookRefused):
    status = 404
    code = "unknown_source"

    def __init__(self, slug: str):
        super().__init__(f"There is no webhook source “{slug}” accepting events.", source=slug)


class SignatureMissing(WebhookRefused):
    status = 401
    code = "signature_missing"

    def __init__(self) -> None:
        super().__init__(
            f"The request has no {SIGNATURE_HEADER} header: sign the raw body with the source's shared "
            f"secret (HMAC-SHA256) and send it as “{SIGNATURE_HEADER}: {SIGNATURE_PREFIX}<hex digest>”."
        )


class BadSignature(WebhookRefused):
    status = 401
    code = "bad_signature"

    def __init__(self, detail: str | None = None) -> None:
        super().__init__(
            detail
            or f"The {SIGNATURE_HEADER} header does not match the body signed with this source's shared "
            "secret (HMAC-SHA256 of the exact bytes sent)."
        )


class BodyTooLarge(WebhookRefused):
    status = 413
    code = "body_too_large"

    def __init__(self, detail: str | None = None) -> None:
        super().__init__(
            detail or f"The request body is larger than {settings.WEBHOOK_MAX_BYTES} bytes (WEBHOOK_MAX_BYTES).",
            limit=settings.WEBHOOK_MAX_BYTES,
        )


class MalformedEvent(WebhookRefused):
    status = 400
    code = "malformed_event"


class MessageIdMissing(WebhookRefused):
    status = 400
    code = "message_id_missing"


class BadAttachments(WebhookRefused):
    status = 400
    code = "bad_attachments"


# Refusals of the inbox desk (admin actions), translated per event like the run desk's.


class EventInFlight(Refusal):
    status = 409
    code = "event_in_flight"

    def __init__(self) -> None:
        super().__init__(
            "This event is being processed (or its worker's lease has not run out yet): wait for the "
            "attempt to finish."
        )


class EventClosed(Refusal):
    status = 409
    code = "event_closed"

    def __init__(self, status: str) -> None:
        super().__init__(
            f"This event is already {status}: there is nothing to retry. {EVENT_FORCE_HINT}", status=status
        )


class NothingToResolve(Refusal):
    status = 409
    code = "nothing_to_resolve"

    def __init__(self, status: str) -> None:
        super().__init__(f"This event is {status}: there is nothing to resolve.", status=status)


class EventNotFound(Refusal):
    status = 404
    code = "not_found"

    def __init__(self, event_id: Any) -> None:
        super().__init__(f"There is no webhook event {event_id}.", event_id=str(event_id))


# --- Sources ---------------------------------------------------------------------------------------


def source_errors(source: WebhookSource) -> dict[str, list[str]]:
    """What is wrong with a source's configuration, by field (empty when it is usable)."""
    errors: dict[str, list[str]] = {}
    spec = None
    try:
        spec = get_agent_spec(source.agent_name)
    except UnknownAgentError as exc:
        errors.setdefault("agent_name", []).append(str(exc))
    header, field = source.message_id_header.strip(), source.message_id_field.strip()
    if bool(header) == bool(field):
        errors.setdefault("message_id_header", []).append(
            "Say where the provider's message id is: a header name or a JSON field path (one of them)."
        )
    if field and any(not part for part in field.split(".")):
        errors.setdefault("message_id_field", []).append(
            "The JSON field path is dotted names, e.g. message.id (no empty parts)."
        )
    if not isinstance(source.params, dict):
        errors.setdefault("params", []).append("params must be a JSON object.")
    elif spec is not None:
        try:
            validate_params(spec, source.params)
        except ScriptError as exc:
            errors.setdefault("params", []).append(f"params.script: {exc}")
    if not source.owner_id or not source.owner_id.strip():
        errors.setdefault("owner_id", []).append("Say which end user the runs act for.")
    return errors


def get_source(slug: str) -> WebhookSource:
    source = WebhookSource.objects.filter(slug=slug, enabled=True).first()
    if source is None:
        raise UnknownSource(slug)
    return source


def sign(secret: str, body: bytes) -> str:
    """The signature header value a provider sends for `body`."""
    return SIGNATURE_PREFIX + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify_signature(source: WebhookSource, body: bytes, header: str | None) -> None:
    if header is None or not header.strip():
        raise SignatureMissing()
    header = header.strip()
    if not header.startswith(SIGNATURE_PREFIX):
        raise BadSignature(
            f"The {SIGNATURE_HEADER} header must read “{SIGNATURE_PREFIX}<hex digest>” (HMAC-SHA256 of the raw body)."
        )
    # Constant time on the bytes: how much of a guess matched never shows in the timing.
    if not hmac.compare_digest(sign(source.secret, body).encode(), header.encode("utf-8", "replace")):
        raise BadSignature()


# --- Receipt ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attachment:
    filename: str
    content_type: str
    data: bytes


def _message_id(source: WebhookSource, payload: dict, headers: Mapping[str, str]) -> str:
    if source.message_id_header:
        value: Any = headers.get(source.message_id_header)
        where = f"header {source.message_id_header}"
    else:
        value = payload
        for part in source.message_id_field.split("."):
            if isinstance(value, dict) and part in value:
                value = value[part]
            elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            else:
                value = None
                break
        where = f"JSON field {source.message_id_field}"
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
            filename = services.clean_file_name(item.get("filename"))
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


def receive_event(*, source: WebhookSource, body: bytes, headers: Mapping[str, str]) -> Receipt:
    """Verify, parse, store (attachments first, then the row) and enqueue one delivery.

    Raises a WebhookRefused for a delivery that is not stored. Returns the first event (created
    False) when the provider's message id was already received from this source.
    """
    if len(body) > settings.WEBHOOK_MAX_BYTES:
        raise BodyTooLarge()
    verify_signature(source, body, headers.get(SIGNATURE_HEADER))
    try:
        payload = safe_json.loads(body)
    except safe_json.UnsafeInput as exc:
        raise MalformedEvent(f"The body is not a JSON event this inbox can store: {exc}") from None
    if not isinstance(payload, dict):
        raise MalformedEvent("The body must be a JSON object.")
    external_id = _message_id(source, payload, headers)

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
                enqueued_at=now,
            )
            # A failed enqueue must not turn a stored event into an error for the provider: the
            # sweeper enqueues received events whose task never came.
            transaction.on_commit(lambda: enqueue_event(event_id), robust=True)
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


def enqueue_event(event_id: uuid.UUID) -> None:
    from django_q.tasks import async_task

    async_task("runs.tasks.process_webhook_event", str(event_id), task_name=f"webhook {event_id}", group="webhooks")


# --- Processing ------------------------------------------------------------------------------------


def retry_delay(attempt: int) -> int:
    """Seconds before the retry that follows failed attempt `attempt` (1-based); the last delay repeats."""
    delays = settings.WEBHOOK_RETRY_DELAYS
    return delays[min(max(attempt, 1), len(delays)) - 1]


def claimable_q(now: datetime) -> Q:
    """Events a worker may take now: new, due for a retry, or left by a worker whose lease ran out."""
    return (
        Q(status=EventStatus.RECEIVED)
        | Q(status=EventStatus.RETRY_WAIT, next_attempt_at__lte=now)
        | Q(status=EventStatus.PROCESSING, lease_expires_at__lt=now)
    )


def last_run(event: WebhookEvent) -> AgentRun | None:
    return AgentRun.objects.filter(webhook_event=event).order_by("-created_at").first()


def _set(event: WebhookEvent, **fields: Any) -> None:
    for key, value in fields.items():
        setattr(event, key, value)
    WebhookEvent.objects.filter(pk=event.pk).update(**fields)


def _short(run: AgentRun) -> str:
    return str(run.run_id)[:8]


def _event_wording(text: str) -> str:
    from runs import replay as rules

    return text.replace(rules.ADMIN_FORCE_HINT, EVENT_FORCE_HINT)


def review_message(event: WebhookEvent, run: AgentRun, refusal: Refusal) -> str:
    attempt = f"Attempt {event.attempts} (run {_short(run)})"
    tools = refusal.context.get("tools")
    if refusal.code == "tools_called" and tools:
        return (
            f"{attempt} called {', '.join(tools)} before failing: processing the event again would call "
            f"them again. {REVIEW_HINT}"
        )
    if refusal.code == "tools_unknown":
        return (
            f"{attempt} failed and it is unknown whether it called any tool before failing (unknown is not "
            f"none): processing the event again could repeat a side effect. {REVIEW_HINT}"
        )
    from runs import replay as rules

    sentence = refusal.admin_detail.replace(" " + rules.ADMIN_FORCE_HINT, "")
    return f"{attempt} cannot simply be repeated: {sentence} {REVIEW_HINT}"


def _run_failure(run: AgentRun) -> str:
    return f"{run.error_code or run.status}: {run.error_message or 'no message'}"


class AttachmentGone(Exception):
    pass


def _open_input(event: WebhookEvent):
    """The first stored attachment, checked against its recorded digest, as (handle, name)."""
    if not event.attachments:
        return None, None
    first = event.attachments[0]
    path = Path(first["path"])
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        raise AttachmentGone(f"The stored copy of the attachment “{first['filename']}” is gone from disk.") from None
    if digest != first["sha256"]:
        raise AttachmentGone(f"The stored copy of the attachment “{first['filename']}” no longer matches what was received.")
    return path.open("rb"), first["filename"]


def _start_attempt(
    event: WebhookEvent,
    *,
    previous: AgentRun | None,
    now: datetime,
    forced_by: Any = None,
    force_reason: str = "",
) -> AgentRun | None:
    """Start the event's next run (under its row lock); None, with the event in review, if it cannot."""
    source = event.source
    handle = None
    try:
        handle, file_name = _open_input(event)
        run = services.start_run(
            agent_name=source.agent_name,
            message=event_message(source, event.external_id, event.payload),
            owner_id=source.owner_id,
            params=source.params,
            file=handle,
            file_name=file_name,
            trigger=Trigger.WEBHOOK,
            enqueue=False,
        )
    except ValidationError as exc:
        problems = "; ".join(f"{field}: {' '.join(msgs)}" for field, msgs in exc.message_dict.items())
        _set(event, status=EventStatus.NEEDS_REVIEW, last_error=(
            f"No run could be started from this event with the source's current settings ({problems}). "
            "Fix the source, then use “Retry now”."
        ), lease_expires_at=None, leased_by="", finished_at=None)
        return None
    except AttachmentGone as exc:
        _set(event, status=EventStatus.NEEDS_REVIEW, last_error=f"{exc} The event cannot be processed as received.",
             lease_expires_at=None, leased_by="", finished_at=None)
        return None
    finally:
        if handle is not None:
            handle.close()
    if run.input_file:
        # Files are not transactional: if the event's transaction rolls back, the caller removes it.
        _track_run_dir(services.run_inputs_dir(run.run_id))
    links = dict(
        webhook_event=event,
        replay_of=previous,
        forced=forced_by is not None,
        forced_by=forced_by,
        force_reason=force_reason,
    )
    AgentRun.objects.filter(pk=run.pk).update(**links)
    for key, value in links.items():
        setattr(run, key, value)
    _set(event, status=EventStatus.PROCESSING, attempts=event.attempts + 1, finished_at=None)
    logger.info("Webhook event %s: attempt %d is run %s", event.event_id, event.attempts, run.run_id)
    return run


# Input copies made by runs started inside the current transaction (one list per thread).
_local = threading.local()


def _track_run_dir(path: Path) -> None:
    if hasattr(_local, "dirs"):
        _local.dirs.append(path)


@contextlib.contextmanager
def files_follow_transaction() -> Iterator[None]:
    """Around a transaction that may start runs: their input copies are removed if it fails."""
    _local.dirs = []
    try:
        yield
    except BaseException:
        for path in _local.dirs:
            shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        del _local.dirs


def _advance(event: WebhookEvent, *, was: str, now: datetime) -> uuid.UUID | None:
    """Move a leased event on from what its last run says; return the run this worker must execute."""
    previous = last_run(event)
    if previous is None:
        run = _start_attempt(event, previous=None, now=now)
        return run.run_id if run is not None else None

    from runs import reconcile
    from runs import replay as rules

    # A run whose worker died is judged as what it is: a failure whose outcome is unknown.
    reconcile.reconcile_run_if_stale(previous)
    if previous.status == RunStatus.QUEUED:
        return previous.run_id
    if previous.status == RunStatus.RUNNING:
        # Its worker is alive (the heartbeat is fresh): look again when this lease runs out.
        return None
    if previous.status == RunStatus.SUCCESS:
        _set(event, status=EventStatus.DONE, last_error="", lease_expires_at=None, leased_by="", finished_at=now)
        return None

    decision = rules.decide(previous, force=False)
    refusal = decision.refusal
    if refusal is not None:
        if refusal.code in {"run_in_flight", "replay_in_flight"}:
            return None
        if refusal.code in {"run_succeeded", "already_replayed"}:
            _set(event, status=EventStatus.DONE, last_error=_event_wording(refusal.admin_detail),
                 lease_expires_at=None, leased_by="", finished_at=now)
            return None
        _set(event, status=EventStatus.NEEDS_REVIEW, last_error=review_message(event, previous, refusal),
             lease_expires_at=None, leased_by="", next_attempt_at=None, finished_at=None)
        logger.warning("Webhook event %s needs review: %s", event.event_id, event.last_error)
        return None

    # The previous attempt provably touched nothing: it may be retried.
    if event.attempts >= settings.WEBHOOK_MAX_ATTEMPTS:
        _set(event, status=EventStatus.DEAD, lease_expires_at=None, leased_by="", next_attempt_at=None,
             finished_at=now, last_error=(
                 f"Gave up after {event.attempts} attempts (WEBHOOK_MAX_ATTEMPTS="
                 f"{settings.WEBHOOK_MAX_ATTEMPTS}), none of which called a tool. The last one (run "
                 f"{_short(previous)}) failed with {_run_failure(previous)}"
             ))
        logger.warning("Webhook event %s is dead: %s", event.event_id, event.last_error)
        return None
    if was == EventStatus.RETRY_WAIT:
        run = _start_attempt(event, previous=previous, now=now)
        return run.run_id if run is not None else None
    delay = retry_delay(event.attempts)
    due = now + timedelta(seconds=delay)
    _set(event, status=EventStatus.RETRY_WAIT, next_attempt_at=due, lease_expires_at=None, leased_by="",
         enqueued_at=None, last_error=(
             f"Attempt {event.attempts} (run {_short(previous)}) failed with {_run_failure(previous)} "
             f"It called no tool, so it is retried in {delay} s."
         ))
    return None


@dataclass(frozen=True)
class Claim:
    event_id: uuid.UUID
    worker: str
    run_id: uuid.UUID | None
    status: str


def _take(queryset, *, worker: str, now: datetime) -> Claim | None:
    """Lease the first claimable event of `queryset` and advance it, in one transaction."""
    with files_follow_transaction(), transaction.atomic():
        event = (
            queryset.select_for_update(skip_locked=True, of=("self",))
            .filter(claimable_q(now))
            .select_related("source")
            .first()
        )
        if event is None:
            return None
        was = event.status
        # Conditional on what was read: on SQLite (no row locks) the IMMEDIATE transaction already
        # serialises claimants, and the row count keeps the claim honest anywhere.
        taken = WebhookEvent.objects.filter(
            pk=event.pk, status=was, lease_expires_at=event.lease_expires_at
        ).update(
            status=EventStatus.PROCESSING,
            lease_expires_at=now + timedelta(seconds=settings.WEBHOOK_LEASE_SECONDS),
            leased_by=worker,
            enqueued_at=None,
        )
        if not taken:
            return None
        event.status = EventStatus.PROCESSING
        event.leased_by = worker
        run_id = _advance(event, was=was, now=now)
        return Claim(event.event_id, worker, run_id, event.status)


def claim_event(*, event_id: Any, worker: str, now: datetime | None = None) -> Claim | None:
    """Lease this event if it is claimable now (and nobody holds its row); None otherwise."""
    return _take(WebhookEvent.objects.filter(pk=event_id), worker=worker, now=now or timezone.now())


def claim_next(*, worker: str, now: datetime | None = None) -> Claim | None:
    """Lease the next claimable event, skipping rows other workers hold.

    One scan per kind of due event, each a range on its own index, rather than one OR over the
    table that the planner could answer by walking every settled event. Due retries and expired
    leases go first: they are few, and new events keep arriving.
    """
    now = now or timezone.now()
    scans = (
        WebhookEvent.objects.filter(status=EventStatus.RETRY_WAIT, next_attempt_at__lte=now).order_by("next_attempt_at"),
        WebhookEvent.objects.filter(status=EventStatus.PROCESSING, lease_expires_at__lt=now).order_by("lease_expires_at"),
        WebhookEvent.objects.filter(status=EventStatus.RECEIVED).order_by("next_attempt_at"),
    )
    for scan in scans:
        claim = _take(scan, worker=worker, now=now)
        if claim is not None:
            return claim
    return None


class LeaseKeeper:
    """Renews a worker's lease on an event while it executes the event's run (a plain thread,
    like the run's heartbeat, so a busy event loop cannot make a live worker look gone)."""

    def __init__(self, event_id: uuid.UUID, worker: str):
        self.event_id, self.worker = event_id, worker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{event_id}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        period = settings.WEBHOOK_LEASE_SECONDS / 3
        try:
            while not self._stop.wait(period):
                try:
                    renewed = WebhookEvent.objects.filter(
                        pk=self.event_id, status=EventStatus.PROCESSING, leased_by=self.worker
                    ).update(lease_expires_at=timezone.now() + timedelta(seconds=settings.WEBHOOK_LEASE_SECONDS))
                except Exception:  # noqa: BLE001 - a hiccup must not stop the run; the next try may work
                    logger.exception("Webhook event %s: the lease could not be renewed", self.event_id)
                    close_old_connections()
                    continue
                if not renewed:
                    return  # someone else moved the event on; nothing left to keep
        finally:
            connection.close()


def _after_run(claim: Claim) -> str:
    """Settle the event from the outcome of the run this worker just executed."""
    now = timezone.now()
    with files_follow_transaction(), transaction.atomic():
        event = WebhookEvent.objects.select_for_update().select_related("source").filter(pk=claim.event_id).first()
        if event is None or event.status != EventStatus.PROCESSING:
            return event.status if event is not None else "gone"
        current = last_run(event)
        if current is None or current.run_id != claim.run_id:
            return event.status  # another attempt was started meanwhile; it is someone else's now
        _advance(event, was=EventStatus.PROCESSING, now=now)
        return event.status


def work(claim: Claim) -> str:
    """Execute the claimed event's run here, then settle the event; returns its status."""
    from runs import executor

    if claim.run_id is None:
        return claim.status
    with LeaseKeeper(claim.event_id, claim.worker):
        executor.execute(claim.run_id)
    return _after_run(claim)


def process_event(*, event_id: Any, worker: str | None = None) -> str:
    """The task's body: claim the event, run its attempt, settle it. Safe to call any number of times."""
    claim = claim_event(event_id=event_id, worker=worker or services.worker_name())
    if claim is None:
        return "not claimed"
    return work(claim)


def process_due(*, worker: str | None = None, limit: int | None = None) -> int:
    """Process claimable events one after another until none is left (or `limit`); return how many."""
    worker = worker or services.worker_name()
    done = 0
    while limit is None or done < limit:
        claim = claim_next(worker=worker)
        if claim is None:
            break
        work(claim)
        done += 1
    return done


# --- The sweeper -----------------------------------------------------------------------------------


def due_q(now: datetime) -> Q:
    """Events that need a worker and have no task on its way (or whose task was lost)."""
    stale_enqueue = now - timedelta(seconds=settings.WEBHOOK_LEASE_SECONDS)
    return claimable_q(now) & (Q(enqueued_at__isnull=True) | Q(enqueued_at__lt=stale_enqueue))


def sweep(*, now: datetime | None = None) -> list[uuid.UUID]:
    """Every minute: enqueue due retries, expired leases and received events whose task was lost.

    Each event's `enqueued_at` is claimed with a conditional UPDATE first, so concurrent sweeps
    enqueue it once, and an event waiting behind a backlog is enqueued once per lease period.
    """
    now = now or timezone.now()
    candidates = list(WebhookEvent.objects.filter(due_q(now)).order_by("received_at").values_list("pk", "enqueued_at")[:5000])
    enqueued: list[uuid.UUID] = []
    for event_id, previous in candidates:
        with transaction.atomic():
            if WebhookEvent.objects.filter(due_q(now), pk=event_id, enqueued_at=previous).update(enqueued_at=now):
                transaction.on_commit(lambda event_id=event_id: enqueue_event(event_id))
                enqueued.append(event_id)
    if enqueued:
        logger.info("Webhook sweeper enqueued %d event(s)", len(enqueued))
    return enqueued


# --- The inbox desk: retry now, force reprocess, mark resolved -------------------------------------


def _locked_event(event_id: Any) -> WebhookEvent:
    try:
        return WebhookEvent.objects.select_for_update().select_related("source").get(pk=event_id)
    except (WebhookEvent.DoesNotExist, ValidationError, ValueError):
        raise EventNotFound(event_id) from None


def _hand_to_worker(event: WebhookEvent, now: datetime) -> None:
    """The run is written; a worker executes it: the lease is left expired so the task can claim it."""
    _set(event, status=EventStatus.PROCESSING, lease_expires_at=now, leased_by="", enqueued_at=now,
         next_attempt_at=None)
    event_id = event.event_id
    transaction.on_commit(lambda: enqueue_event(event_id), robust=True)


def _log(actor: Any, obj: Any, flag: int, message: str) -> None:
    from django.contrib.admin.models import LogEntry

    if getattr(actor, "pk", None) is not None:
        LogEntry.objects.log_actions(actor.pk, [obj], flag, message, single_object=True)


def retry_event(event_id: Any, *, actor: Any) -> AgentRun:
    """Process the event again now, if the replay rules allow it (a person's “Retry now”).

    The attempts ceiling does not apply: a person asked. Returns the new run.
    """
    from django.contrib.admin.models import CHANGE

    from runs import reconcile
    from runs import replay as rules

    now = timezone.now()
    with files_follow_transaction(), transaction.atomic():
        event = _locked_event(event_id)
        if event.status == EventStatus.PROCESSING:
            raise EventInFlight()
        if event.status in {EventStatus.DONE, EventStatus.RESOLVED}:
            raise EventClosed(event.get_status_display())
        previous = last_run(event)
        if previous is not None:
            reconcile.reconcile_run_if_stale(previous)
            decision = rules.decide(previous, force=False)
            if decision.refusal is not None:
                raise decision.refusal
        run = _start_attempt(event, previous=previous, now=now)
        if run is None:
            raise Refusal(event.last_error)
        _hand_to_worker(event, now)
        _log(actor, event, CHANGE, f"Retried now as run {run.run_id} (attempt {event.attempts}).")
    return run


def force_reprocess_event(event_id: Any, *, actor: Any, reason: str) -> AgentRun:
    """Process the event again even where the rules refuse (tools called, unknown, done, resolved)."""
    from django.contrib.admin.models import CHANGE

    from runs import reconcile
    from runs import replay as rules

    if not services.can_force_replay(actor):
        raise ForceNotPermitted()
    reason = (reason or "").strip()
    if not reason:
        raise ReasonRequired()
    if len(reason) > services.MAX_FORCE_REASON_CHARS:
        raise ReasonTooLong(services.MAX_FORCE_REASON_CHARS)
    now = timezone.now()
    with files_follow_transaction(), transaction.atomic():
        event = _locked_event(event_id)
        if event.status == EventStatus.PROCESSING:
            raise EventInFlight()
        previous = last_run(event)
        overridden = ""
        if previous is not None:
            reconcile.reconcile_run_if_stale(previous)
            decision = rules.decide(previous, force=True)
            if decision.refusal is not None:
                raise decision.refusal
            overridden = decision.overridden.code if decision.overridden is not None else ""
        if not overridden and event.status in {EventStatus.DONE, EventStatus.RESOLVED}:
            overridden = f"event_{event.status}"
        forced = bool(overridden)
        run = _start_attempt(
            event, previous=previous, now=now, forced_by=actor if forced else None, force_reason=reason if forced else ""
        )
        if run is None:
            raise Refusal(event.last_error)
        _hand_to_worker(event, now)
        what = f", overriding “{overridden}”" if forced else ""
        _log(actor, event, CHANGE, f"Force-reprocessed as run {run.run_id}{what}. Reason: {reason}")
        if forced:
            _log(actor, run, CHANGE, f"Started by forcing webhook event {event.event_id}{what}. Reason: {reason}")
    return run


def resolve_event(event_id: Any, *, actor: Any) -> WebhookEvent:
    """A person handled the event (or decided it needs nothing more): it is closed, never retried."""
    from django.contrib.admin.models import CHANGE

    now = timezone.now()
    with transaction.atomic():
        event = _locked_event(event_id)
        if event.status == EventStatus.PROCESSING:
            raise EventInFlight()
        if event.status in {EventStatus.DONE, EventStatus.RESOLVED}:
            raise NothingToResolve(event.get_status_display())
        was = event.get_status_display()
        _set(event, status=EventStatus.RESOLVED, lease_expires_at=None, leased_by="", next_attempt_at=None,
             finished_at=now, resolved_by=actor if getattr(actor, "is_authenticated", False) else None)
        _log(actor, event, CHANGE, f"Marked resolved (it was {was}).")
    return event
