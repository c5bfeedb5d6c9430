"""The memory diet: old turns reach the model without their large base64 payloads.

Every model call re-sends the whole conversation. An image attached five turns ago would be
sent (and billed, and held in memory) on every call after it. `strip_old_payloads` is a
`before_model_callback` that replaces, in every content before the latest turn:

- each inline data part (images, files) with the text `<stripped: N chars>`;
- each base64-looking string of at least STRIP_PAYLOAD_MIN_CHARS characters inside a function
  response with the same marker,

where N is the length of the base64 text the payload would have taken in the request.

The current turn — from the run's own message (its text and file) on, so every tool answer since —
is sent whole on every model call of the run: the model needs what it was just given. The run's
message is found as ADK's invocation knows it, not as "the latest user content": ADK inserts
request-scoped user contents of its own (preload_memory's `<PAST_CONVERSATIONS>` block goes after
the latest tool answer), and taking one of those for the turn's start would strip the run's own
file and the latest tool answers. Ordinary long text is never touched, and neither is the stored session: ADK
hands the callback shallow copies of the session's contents whose nested payloads are shared
with the session events, so parts are replaced, never modified in place.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from django.conf import settings
from google.adk.agents.callback_context import CallbackContext
from google.adk.models.llm_request import LlmRequest
from google.genai import types

logger = logging.getLogger(__name__)

# Standard or URL-safe base64, optionally wrapped in lines (MIME) and optionally a data: URL.
# No spaces: prose always has them, base64 never does.
_BASE64 = re.compile(r"(?:data:[\w.+-]+/[\w.+-]+(?:;[\w.+-]+=[\w.+-]+)*;base64,)?[A-Za-z0-9+/_\-\r\n]+={0,2}\s*")


def marker(chars: int) -> str:
    return f"<stripped: {chars} chars>"


def base64_chars(byte_count: int) -> int:
    return 4 * ((byte_count + 2) // 3)


def looks_like_base64(value: str, *, min_chars: int) -> bool:
    return len(value) >= min_chars and _BASE64.fullmatch(value) is not None


def _strip_value(value: Any, min_chars: int) -> tuple[Any, int]:
    """A copy of `value` with its base64 strings replaced, and how many characters went."""
    if isinstance(value, str):
        if looks_like_base64(value, min_chars=min_chars):
            return marker(len(value)), len(value)
        return value, 0
    if isinstance(value, dict):
        removed = 0
        result = {}
        for key, item in value.items():
            result[key], item_removed = _strip_value(item, min_chars)
            removed += item_removed
        return (result, removed) if removed else (value, 0)
    if isinstance(value, list | tuple):
        removed = 0
        items = []
        for item in value:
            stripped, item_removed = _strip_value(item, min_chars)
            items.append(stripped)
            removed += item_removed
        return (type(value)(items), removed) if removed else (value, 0)
    return value, 0


def _strip_part(part: types.Part, min_chars: int) -> tuple[types.Part, int] | None:
    """The replacement for `part` and the characters it saves, or None to keep it as it is."""
    if part.inline_data is not None and part.inline_data.data:
        chars = base64_chars(len(part.inline_data.data))
        return types.Part(text=marker(chars)), chars
    if part.function_response is not None and part.function_response.response:
        response, removed = _strip_value(part.function_response.response, min_chars)
        if removed:
            function_response = part.function_response.model_copy(update={"response": response})
            return part.model_copy(update={"function_response": function_response}), removed
    return None


def _is_user_message(content: types.Content) -> bool:
    # Tool results also travel with role "user"; a user message is one that is not only those.
    return content.role == "user" and any(part.function_response is None for part in content.parts or [])


# What ADK's preload_memory puts before the model (tools/preload_memory_tool.py): not a message.
_MEMORY_BLOCK = "<PAST_CONVERSATIONS>"


def _is_inserted_context(content: types.Content) -> bool:
    return any(_MEMORY_BLOCK in (part.text or "") for part in content.parts or [])


def _shape(content: types.Content) -> list[tuple]:
    # Compared by what the model reads: a stored message may come back without a file's display name.
    return [
        (part.text, part.inline_data.mime_type, len(part.inline_data.data or b""))
        if part.inline_data is not None
        else (part.text, None, None)
        for part in content.parts or []
    ]


def latest_turn_start(contents: list[types.Content], own_message: types.Content | None = None) -> int:
    """Where the current turn starts: the run's own message, else the latest message of a person."""
    if own_message is not None and own_message.parts:
        shape = _shape(own_message)
        for index in range(len(contents) - 1, -1, -1):
            if contents[index].role == "user" and _shape(contents[index]) == shape:
                return index
    for index in range(len(contents) - 1, -1, -1):
        if _is_user_message(contents[index]) and not _is_inserted_context(contents[index]):
            return index
    return max(len(contents) - 1, 0)


def strip_contents(
    contents: list[types.Content], *, min_chars: int, own_message: types.Content | None = None
) -> tuple[list[types.Content], int]:
    """New contents with old payloads stripped, and the number of payload characters removed."""
    keep_from = latest_turn_start(contents, own_message)
    result: list[types.Content] = []
    removed = 0
    for index, content in enumerate(contents):
        if index >= keep_from or not content.parts:
            result.append(content)
            continue
        parts: list[types.Part] = []
        changed = False
        for part in content.parts:
            replacement = _strip_part(part, min_chars)
            if replacement is None:
                parts.append(part)
            else:
                parts.append(replacement[0])
                removed += replacement[1]
                changed = True
        result.append(content.model_copy(update={"parts": parts}) if changed else content)
    return result, removed


def strip_old_payloads(callback_context: CallbackContext, llm_request: LlmRequest) -> None:
    """before_model_callback: returns None so the (lighter) request goes to the model."""
    llm_request.contents, removed = strip_contents(
        llm_request.contents,
        min_chars=settings.STRIP_PAYLOAD_MIN_CHARS,
        own_message=getattr(callback_context, "user_content", None),
    )
    if removed:
        logger.debug("Stripped %d characters of old payloads from a model request", removed)
    return None
