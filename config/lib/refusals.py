"""The one family of refusals: every rule that says no raises a subclass of `Refusal`.

A refusal carries its HTTP status, a stable `code`, the sentence the API says (`detail`), the
sentence the admin says (`admin_detail`, which differs only where it tells a person what to do
next) and context for machines (`tools`, `replay_run_id`, …). Each door translates the family
once: the API's exception handler answers `{"code", "detail", ...context}` with the status, and
the admin reports `admin_detail` once per object. Policy reads the class, never the code string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ValidationError


class Refusal(Exception):
    status: int = 409
    code: str = "refused"

    def __init__(self, detail: str, *, admin_detail: str | None = None, **context: Any):
        super().__init__(detail)
        self.detail = detail
        self.admin_detail = admin_detail if admin_detail is not None else detail
        self.context = {key: value for key, value in context.items() if value is not None}

    def as_dict(self) -> dict[str, Any]:
        """The API's error body: `{"code", "detail", ...context}`."""
        return {**self.context, "code": self.code, "detail": self.detail}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.detail!r})"


def required_text(
    value: Any, *, limit: int, missing: Callable[[], Refusal], too_long: Callable[[int], Refusal]
) -> str:
    """A person's words a rule requires (a force's reason, a settlement's note): given, not too long."""
    text = value.strip() if isinstance(value, str) else ""
    if not text:
        raise missing()
    if len(text) > limit:
        raise too_long(limit)
    return text


class TooLargeInput(ValidationError):
    """A field error that is a size limit: every door reads it as a ValidationError; the API answers 413."""

    def __init__(self, errors: dict, *, limit: int):
        super().__init__(errors)
        self.limit = limit
