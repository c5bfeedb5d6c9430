"""One strict reading of JSON (and of the strings inside it) for every door that takes it.

Python's `json` module accepts what no database or client should have to store: NaN and
Infinity, floats that overflow to infinity (1e309), integers of thousands of digits (whose
conversion is quadratic, and which `int()` refuses past 4300 digits with a ValueError, not a
JSON error), nesting deep enough to exhaust the interpreter's stack, NUL characters (which
PostgreSQL refuses in text and jsonb) and lone surrogates (which cannot be encoded as UTF-8, so
a row holding one breaks every later read that serialises it). Each is refused here, at input,
with a sentence naming the problem and where it is, so nothing hostile is ever written.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

# Deep enough for any real document (scripts, webhook payloads), far from the interpreter's stack.
MAX_DEPTH = 32
# Longer than any identifier or amount; far below the digits where int() turns quadratic.
MAX_INT_DIGITS = 64
MAX_FLOAT_CHARS = 64
_INT_CEILING = 10**MAX_INT_DIGITS

# A JSON string, quotes included (the unrolled form scans in linear time).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class UnsafeInput(ValueError):
    """Input refused before anything is stored; the message says what and where."""


def text_problem(value: str) -> str | None:
    """Why this string cannot be stored as text, or None."""
    if "\x00" in value:
        return "contains a NUL character (\\u0000)"
    if _LONE_SURROGATE.search(value):
        return "contains a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not Unicode text"
    return None


def check_text(value: str, *, where: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        raise UnsafeInput(f"{where} {problem}.")
    return value


def _describe(path: Iterable[str | int]) -> str:
    parts = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path)
    return parts.lstrip(".") or "the document"


def check_value(value: Any, *, where: str = "", max_depth: int = MAX_DEPTH) -> Any:
    """Check a decoded JSON value (iteratively: its depth is what is being checked); return it."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, (where,) if where else ())]
    while stack:
        item, path = stack.pop()
        if len(path) - (1 if where else 0) > max_depth:
            raise UnsafeInput(f"{_describe(path)} is nested more than {max_depth} levels deep.")
        if isinstance(item, str):
            check_text(item, where=_describe(path))
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if abs(item) >= _INT_CEILING:
                raise UnsafeInput(f"{_describe(path)} is an integer of more than {MAX_INT_DIGITS} digits.")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise UnsafeInput(f"{_describe(path)} is not a finite number (NaN and Infinity are not JSON).")
        elif isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise UnsafeInput(f"{_describe(path)} has a key that is not a string.")
                check_text(key, where=f"A key of {_describe(path)}")
                stack.append((child, (*path, key)))
        elif isinstance(item, list | tuple):
            stack.extend((child, (*path, index)) for index, child in enumerate(item))
        else:
            raise UnsafeInput(f"{_describe(path)} is not a JSON value.")
    return value


def _depth_problem(text: str, max_depth: int) -> bool:
    """True if brackets outside strings nest deeper than `max_depth` (checked before parsing,
    because the parser itself recurses once per level)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = 0
    for char in brackets:
        if char in "[{":
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
    return False


def _refuse_constant(name: str) -> Any:
    raise UnsafeInput(f"{name} is not a number JSON can carry; send a finite number or a string.")


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise UnsafeInput(f"An integer of {len(digits.lstrip('-'))} digits is longer than {MAX_INT_DIGITS}.")
    return int(digits)


def _parse_float(text: str) -> float:
    if len(text) > MAX_FLOAT_CHARS:
        raise UnsafeInput(f"A number written with {len(text)} characters is longer than {MAX_FLOAT_CHARS}.")
    number = float(text)
    if not math.isfinite(number):
        raise UnsafeInput(f"The number {text} is too large to be stored (it overflows to infinity).")
    return number


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    # Which of two values "wins" is each reader's choice (Python's json the last, others the first):
    # a body that means two things to two readers is refused, not read one way.
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise UnsafeInput(f"The key {repeated[:64]!r} appears twice in one JSON object; send it once.")
    return value


def loads(data: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Decode JSON strictly. Raises UnsafeInput (a ValueError) with a sentence for any refusal."""
    if isinstance(data, bytes | bytearray):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise UnsafeInput("The body is not UTF-8 text.") from None
    else:
        text = data
    text = text.removeprefix("\ufeff")
    if _depth_problem(text, max_depth):
        raise UnsafeInput(f"The JSON is nested more than {max_depth} levels deep.")
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_int=_parse_int, parse_float=_parse_float,
                           object_pairs_hook=_refuse_duplicate_keys)
    except UnsafeInput:
        raise
    except json.JSONDecodeError as exc:
        raise UnsafeInput(f"This is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}.") from None
    except (ValueError, RecursionError) as exc:
        raise UnsafeInput(f"This JSON cannot be read: {exc}.") from None
    return check_value(value, max_depth=max_depth)
