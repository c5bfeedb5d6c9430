"""What the inbox refuses: deliveries it will not store, and desk actions it will not take.

Each is a `Refusal`, translated once per door like the run ledger's.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from config.lib.refusals import Refusal
from runs.refusals import ReplayRefused

EVENT_FORCE_HINT = "Use “Force reprocess…” to process it again anyway."
REVIEW_HINT = "A person must decide: “Force reprocess…” to process it again anyway, or “Mark resolved”."


class WebhookRefused(Refusal):
    """A delivery the inbox will not store; nothing was written."""


class NotAccepted(WebhookRefused):
    """The one answer to a delivery nobody authenticated: the source does not exist, is disabled, or
    the signature (or the message id it signs) is missing, malformed or wrong. Every such delivery
    hears the same status and the same words, so a caller without the secret learns neither which
    sources exist nor what they expect; the reason goes to the operator's log
    (`runs.inbox.receipt`)."""

    status = 404
    code = "not_accepted"

    def __init__(self) -> None:
        super().__init__(
            "No webhook source here accepts this delivery. If you send events to a source of this "
            "service, check the URL and that each delivery is signed as its settings say."
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


def event_wording(refusal: Refusal) -> str:
    """A refusal as the inbox desk says it: a replay rule's hint points to “Force reprocess…”."""
    if isinstance(refusal, ReplayRefused):
        return refusal.worded(EVENT_FORCE_HINT)
    return refusal.admin_detail
