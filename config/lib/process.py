"""Which kind of process this is. The web server's entry points (config/asgi.py, config/wsgi.py)
mark theirs, so that code shared with workers can refuse what must never happen in a web
process, such as a scripted fault that kills the process it runs in."""

from __future__ import annotations

_web = False


def mark_web_process() -> None:
    global _web
    _web = True


def is_web_process() -> bool:
    return _web
