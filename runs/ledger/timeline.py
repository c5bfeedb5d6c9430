"""A run's ADK session events, in words a person (or a tool) can read.

ADK stores each event as one JSON document. This turns the run's own invocation into plain
records: what the user said (and attached), the model's text, each call with its arguments,
each response, and errors. Attached bytes are described, never copied out: a stored upload can
be megabytes of base64.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from agents.models import AdkEvent
from runs.ledger.journal import ABORTED_RESPONSE
from runs.models.ledger import AgentRun

MAX_EVENTS = 2000


def _attachment(blob: dict) -> dict:
    data = blob.get("data") or ""
    try:
        size = len(base64.b64decode(data, validate=False)) if isinstance(data, str) else len(data)
    except (binascii.Error, ValueError):
        size = None
    return {"display_name": blob.get("display_name") or "", "mime_type": blob.get("mime_type") or "", "size": size}


def describe_event(event: AdkEvent) -> dict[str, Any]:
    data = event.data
    texts, attachments, calls, responses = [], [], [], []
    for part in event.parts:
        if part.get("thought"):
            continue
        if part.get("text"):
            texts.append(part["text"])
        if part.get("inline_data"):
            attachments.append(_attachment(part["inline_data"]))
        if part.get("function_call"):
            call = part["function_call"]
            calls.append({"id": call.get("id") or "", "name": call.get("name") or "", "args": call.get("args") or {}})
        if part.get("function_response"):
            response = part["function_response"]
            payload = response.get("response")
            responses.append(
                {
                    "id": response.get("id") or "",
                    "name": response.get("name") or "",
                    "response": payload,
                    "aborted": isinstance(payload, dict) and payload.get("error") == ABORTED_RESPONSE,
                }
            )
    return {
        "id": event.id,
        "timestamp": event.timestamp,
        "author": event.author,
        "invocation_id": event.invocation_id,
        "text": "\n".join(texts),
        "attachments": attachments,
        "function_calls": calls,
        "function_responses": responses,
        "error_code": data.get("error_code") or "",
        "error_message": data.get("error_message") or "",
    }


def run_events(run: AgentRun) -> list[dict[str, Any]]:
    """The events of this run's invocation, oldest first (a chat session holds other runs too)."""
    events = AdkEvent.objects.of_invocation(
        app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id, invocation_id=run.invocation_id
    )[:MAX_EVENTS]
    return [describe_event(event) for event in events]


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


# ADK words every abort as the client's ("Invocation was aborted by client."); the ledger knows who
# stopped the run, from its outcome.
STOPPED_BY = {
    "worker_shutdown": "the worker shut down",
    "cancelled": "the run was cancelled",
    "timeout": "the run hit its time limit",
    "client_disconnected": "the chat client disconnected",
}


def stopped_by(error_code: str) -> str:
    return STOPPED_BY.get(error_code, "the run was stopped")


def timeline_items(events: list[dict[str, Any]], *, error_code: str = "") -> list[dict[str, Any]]:
    """One line per thing that happened, for the admin's timeline (arguments as readable JSON).

    `error_code` is the run's outcome: an abort is said as what stopped the run."""
    reason = stopped_by(error_code)
    items: list[dict[str, Any]] = []
    for event in events:
        at = event["timestamp"]
        if event["author"] == "user" and not event["function_responses"]:
            items.append({"kind": "user", "at": at, "title": "User message", "text": event["text"],
                          "attachments": event["attachments"]})
            continue
        if event["author"] == "user":
            # A resume's answers to the calls its original left without a response (runs.rules.resume).
            for response in event["function_responses"]:
                items.append({"kind": "response", "at": at, "title": f"{response['name']} answered by the resume",
                              "call_id": response["id"], "data": _pretty(response["response"])})
            continue
        if event["text"]:
            items.append({"kind": "model", "at": at, "title": f"{event['author']} said", "text": event["text"]})
        for call in event["function_calls"]:
            items.append({"kind": "call", "at": at, "title": f"called {call['name']}", "call_id": call["id"],
                          "data": _pretty(call["args"])})
        for response in event["function_responses"]:
            if response["aborted"]:
                items.append({"kind": "aborted", "at": at,
                              "title": f"{response['name']} was stopped before it answered: {reason}",
                              "call_id": response["id"], "data": ""})
            else:
                items.append({"kind": "response", "at": at, "title": f"{response['name']} answered",
                              "call_id": response["id"], "data": _pretty(response["response"])})
        if event["error_code"] == "INVOCATION_ABORTED":
            items.append({"kind": "aborted", "at": at, "title": "Stopped", "text": f"Aborted: {reason}."})
        elif event["error_code"]:
            items.append({"kind": "error", "at": at, "title": f"Error {event['error_code']}",
                          "text": event["error_message"]})
    return items
