"""An MCP tool's answer as people read it: the value the server meant, not its wire envelope.

ADK hands the model an MCP `CallToolResult` as it came: `{"content": [{"type": "text", "text":
"{\"status\": \"open\"}"}], "structuredContent": {...}, "isError": false}`. Shown as it is, a JSON
answer is JSON inside a string inside JSON. The readable form is the server's structured content
when it gives one, else each text part (parsed when it is JSON), with an error said as one.
"""

from __future__ import annotations

import json
from typing import Any

ENVELOPE_KEYS = {"content", "structuredContent", "isError", "_meta", "meta"}


def is_mcp_result(payload: Any) -> bool:
    return (
        isinstance(payload, dict)
        and isinstance(payload.get("content"), list)
        and set(payload) <= ENVELOPE_KEYS
        and all(isinstance(part, dict) and "type" in part for part in payload["content"])
    )


def _part(part: dict) -> Any:
    if part.get("type") != "text" or not isinstance(part.get("text"), str):
        return part
    text = part["text"]
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict | list) else text


def readable_answer(payload: Any) -> Any:
    """The payload unchanged unless it is an MCP result; then the value inside it."""
    if not is_mcp_result(payload):
        return payload
    if isinstance(payload.get("structuredContent"), dict | list):
        value: Any = payload["structuredContent"]
    else:
        parts = [_part(part) for part in payload["content"]]
        value = parts[0] if len(parts) == 1 else parts
    return {"error": value} if payload.get("isError") else value
