"""The `support` agent's tools. Each has a real, visible effect (or, for the lookup, none)."""

from __future__ import annotations

import uuid

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.mail import send_mail
from google.adk.tools import ToolContext

from agents.effects import idempotent, read_only
from agents.models import CrmNote, Customer, OutboxEmail, Refund


def _run_id(tool_context: ToolContext) -> uuid.UUID | None:
    run_id = (tool_context.custom_metadata or {}).get("run_id")
    try:
        return uuid.UUID(str(run_id)) if run_id else None
    except ValueError:
        return None


def _send(run_id: uuid.UUID | None, call_id: str, to: str, subject: str, body: str) -> OutboxEmail:
    email = OutboxEmail.objects.create(run_id=run_id, call_id=call_id, to=to, subject=subject, body=body)
    send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, [to])
    return email


# The recipient is the business key: the run's intent (e.g. "tell Jane about her refund") emails a
# person once. The subject must agree for a repeat to count as the same email, so a replay whose
# model changes the subject is refused instead of sending a second email; the body is prose the
# model rewrites freely, so it is in neither and a rewritten body is still the same email.
@idempotent(key="to", stable=("subject",))
async def send_email(to: str, subject: str, body: str, tool_context: ToolContext) -> dict:
    """Send an email to a customer.

    Args:
      to: The recipient's email address.
      subject: The subject line.
      body: The plain-text body.
    """
    email = await sync_to_async(_send)(
        _run_id(tool_context), tool_context.function_call_id or "", to, subject, body
    )
    return {"status": "sent", "message_id": f"outbox-{email.pk}", "to": to}


# One note per contact per intent: the note's wording is the model's and may change on a replay.
@idempotent(key="contact_id")
async def update_crm(contact_id: str, note: str, tool_context: ToolContext) -> dict:
    """Append a note to a customer's CRM record.

    Args:
      contact_id: The CRM contact id, e.g. "C-1001".
      note: The note to append.
    """
    crm_note = await CrmNote.objects.acreate(
        run_id=_run_id(tool_context),
        call_id=tool_context.function_call_id or "",
        contact_id=contact_id,
        note=note,
    )
    return {"status": "noted", "note_id": crm_note.pk, "contact_id": contact_id}


@read_only
async def lookup_customer(email: str, tool_context: ToolContext) -> dict:
    """Look up a customer by email address. Reads only.

    Args:
      email: The customer's email address.
    """
    customer = await Customer.objects.filter(email__iexact=email).afirst()
    if customer is None:
        return {"found": False, "email": email}
    return {
        "found": True,
        "email": customer.email,
        "name": customer.name,
        "contact_id": customer.contact_id,
        "plan": customer.plan,
    }


# Refunds above this need a person's approval first (ADK's require_confirmation, in the agent).
REFUND_APPROVAL_ABOVE_CENTS = 10_000


def refund_needs_approval(order_id: str, amount_cents: int, **_: object) -> bool:
    """ADK's `require_confirmation` callable: a refund above REFUND_APPROVAL_ABOVE_CENTS waits for a person."""
    try:
        return int(amount_cents) > REFUND_APPROVAL_ABOVE_CENTS
    except (TypeError, ValueError):
        return True  # an amount nobody can read is for a person to look at


# One refund per order per intent: approving it twice, or replaying the run, never pays twice.
@idempotent(key="order_id", stable=("amount_cents",))
async def issue_refund(order_id: str, amount_cents: int, tool_context: ToolContext) -> dict:
    """Refund a customer's order. Refunds above 100.00 wait for a person's approval.

    Args:
      order_id: The order to refund, e.g. "A-1001".
      amount_cents: The amount to refund, in cents.
    """
    if not isinstance(amount_cents, int) or isinstance(amount_cents, bool) or amount_cents <= 0:
        return {"status": "refused", "error": "amount_cents must be a positive whole number of cents."}
    refund = await Refund.objects.acreate(
        run_id=_run_id(tool_context),
        call_id=tool_context.function_call_id or "",
        order_id=order_id,
        amount_cents=amount_cents,
    )
    return {"status": "refunded", "refund_id": f"refund-{refund.pk}", "order_id": order_id,
            "amount_cents": amount_cents}


async def request_return_label(order_id: str, tool_context: ToolContext) -> None:
    """Ask the warehouse for a return label for an order. The warehouse answers later, with the label.

    Args:
      order_id: The order to return, e.g. "A-1001".
    """
    # No answer now: the call waits until the warehouse posts its result for this call.
    return None
