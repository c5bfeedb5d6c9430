"""What people who may not configure agents see of an agent package's sources.

A tool's source can carry secrets: an MCP server's command line (`--api-key=…`), its URL (a user
and password, a token in the query or the path), error texts that repeat either, and absolute
paths that map the machine. People without `agents.configure_agents` see the program and the
script it starts, the URL's scheme and host, and file names without their folders.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from urllib.parse import urlsplit

# The script a launcher starts names the server without giving anything away; any other argument
# may be a secret, so it is counted, not shown.
SCRIPT_SUFFIXES = (".py", ".js", ".mjs", ".cjs", ".ts", ".sh", ".jar")
HIDDEN = "…"

_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
# An absolute POSIX path of two parts or more (a file name alone is kept).
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/-])(?:/[^\s/'\"<>:,;()]+)+/([^\s/'\"<>:,;()]+)")


def public_command(command: str, args: list[str]) -> str:
    """`python server.py (3 arguments hidden)`: the program and script names, never the other arguments."""
    shown = [PurePosixPath(command).name or command]
    hidden = 0
    script_shown = False
    for arg in args:
        if not script_shown and not arg.startswith("-") and "=" not in arg and arg.lower().endswith(SCRIPT_SUFFIXES):
            shown.append(PurePosixPath(arg).name)
            script_shown = True
        else:
            hidden += 1
    if hidden:
        shown.append(f"({hidden} argument{'s' if hidden != 1 else ''} hidden)")
    return " ".join(shown)


def public_url(url: str) -> str:
    """`https://mcp.example.com/…`: the scheme and the host; no user, password, path, query or fragment."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return HIDDEN
    if not parts.scheme or not host:
        return HIDDEN
    rest = HIDDEN if (parts.path not in ("", "/") or parts.query or parts.fragment) else ""
    return f"{parts.scheme}://{host}{port}/{rest}"


def public_text(text: str, *, replacements: dict[str, str] | None = None) -> str:
    """An error text with each known secret-bearing string replaced, then URLs and folders taken out."""
    for secret, shown in sorted((replacements or {}).items(), key=lambda item: -len(item[0])):
        if secret:
            text = text.replace(secret, shown)
    text = _URL.sub(lambda match: public_url(match.group(0)), text)
    return _ABSOLUTE_PATH.sub(lambda match: f"{HIDDEN}/{match.group(1)}", text)
