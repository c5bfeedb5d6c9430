"""Credentials inside URLs (`postgres://user:password@host/db`, DSNs) never leave the process.

Pure and dependency-free, so that settings can use it in their own error messages too.
"""

from __future__ import annotations

import re

MASK = "********"
# scheme://user:password@  — the password is whatever sits between the first ':' after the
# scheme's '//' and the last '@' before the host.
_URL_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*:)(?P<secret>[^\s]*?)(?P<tail>@[^\s@/]+)")
# key=value DSNs (libpq style): password=… up to the next space.
_DSN_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<secret>'[^']*'|\S+)", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every URL or DSN password replaced by a mask."""
    text = _URL_CREDENTIALS.sub(lambda m: f"{m['head']}{MASK}{m['tail']}", text)
    return _DSN_PASSWORD.sub(lambda m: f"{m['head']}{MASK}", text)


def has_credentials(text: str) -> bool:
    return redact(text) != text
