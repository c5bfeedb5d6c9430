"""What a person's words may hold: text that reads as what it is.

Notes and reasons are shown to other people on the run page and in the audit log. Control
characters (other than line breaks and tabs) and invisible formatting characters — bidi
overrides such as U+202E, which make text read in a different order than it was written,
zero-width marks — let one person's words read as something else to the next, so they are
refused rather than stored.
"""

from __future__ import annotations

import unicodedata

ALLOWED_CONTROLS = frozenset("\n\r\t")


def hidden_character(text: str) -> str | None:
    """A description of the first control or invisible formatting character in `text`, or None."""
    for position, char in enumerate(text):
        if char in ALLOWED_CONTROLS:
            continue
        category = unicodedata.category(char)
        # Private-use and not-yet-assigned characters show as a glyph or a box: seen, not hidden.
        if category in {"Cc", "Cf", "Cs"}:
            kind = "a control character" if category == "Cc" else "an invisible formatting character"
            name = unicodedata.name(char, "")
            return f"{kind} U+{ord(char):04X}{f' ({name})' if name else ''} at position {position}"
    return None
