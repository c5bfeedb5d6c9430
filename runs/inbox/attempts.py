"""Starting an event's next attempt: a run written under the event's row lock, with its input copied.

Used by the workers (processing) and by the desk (a person's “Retry now” or “Force reprocess…”).
Files are not transactional, so input copies made inside a transaction that fails are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from django.core.exceptions import ValidationError

from runs.inbox import receipt
from runs.models.inbox import EventStatus, WebhookEvent
from runs.models.ledger import AgentRun, Trigger
from runs.services import run as services

logger = logging.getLogger(__name__)


def last_run(event: WebhookEvent) -> AgentRun | None:
    return AgentRun.objects.filter(webhook_event=event).order_by("-created_at").first()


def update_event(event: WebhookEvent, **fields: Any) -> None:
    for key, value in fields.items():
        setattr(event, key, value)
    WebhookEvent.objects.filter(pk=event.pk).update(**fields)


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


def start_attempt(
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
            message=receipt.event_message(source, event.external_id, event.payload),
            owner_id=source.owner_id,
            params=source.params,
            file=handle,
            file_name=file_name,
            trigger=Trigger.WEBHOOK,
            enqueue=False,
        )
    except ValidationError as exc:
        problems = "; ".join(f"{field}: {' '.join(msgs)}" for field, msgs in exc.message_dict.items())
        update_event(event, status=EventStatus.NEEDS_REVIEW, last_error=(
            f"No run could be started from this event with the source's current settings ({problems}). "
            "Fix the source, then use “Retry now”."
        ), lease_expires_at=None, leased_by="", finished_at=None)
        return None
    except AttachmentGone as exc:
        update_event(event, status=EventStatus.NEEDS_REVIEW, last_error=f"{exc} The event cannot be processed as received.",
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
    update_event(event, status=EventStatus.PROCESSING, attempts=event.attempts + 1, finished_at=None)
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
