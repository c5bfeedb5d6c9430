"""The desk's template filters: one time format everywhere (`when`) and the status badge."""

from __future__ import annotations

from datetime import datetime

from django import template
from django.utils import timezone
from django.utils.html import format_html

register = template.Library()

TIME_FORMAT = "%Y-%m-%d %H:%M:%S %Z"
TONES = {"success": "good", "error": "bad", "cancelled": "quiet", "waiting": "attention", "running": "busy",
         "queued": "busy"}


def when(value: datetime | None) -> str:
    """A moment as the desk writes it everywhere: date, seconds, the desk's time zone."""
    if not value:
        return "—"
    return timezone.localtime(value).strftime(TIME_FORMAT)


def badge(status: str, tone: str = "") -> str:
    """A status as a coloured label that never wraps."""
    return format_html('<span class="ledger-badge tone-{}">{}</span>', tone or TONES.get(status, "quiet"), status)


register.filter("when", when)
register.filter("badge", badge)
