"""Tool faults requested by the scripted model, delivered to the tool it calls.

The scripted model arms a fault under the function call id it emits; the tool looks it up by
`tool_context.function_call_id` and fails for real: it raises after doing its effect, hangs, or
kills its own process with SIGKILL (no `finally`, no response) before or after the effect.
"""

import asyncio
import os
import signal
import threading

from django.conf import settings

_armed: dict[str, dict] = {}
_lock = threading.Lock()


class ScriptedToolError(RuntimeError):
    """The error a tool raises for a `tool_fails` fault, after it has done its effect."""


def arm(call_id: str, fault: dict) -> None:
    with _lock:
        _armed[call_id] = dict(fault)


def take(call_id: str | None) -> dict:
    if not call_id:
        return {}
    with _lock:
        return _armed.pop(call_id, {})


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def before_effect(fault: dict) -> None:
    if not fault or not settings.SCRIPTED_FAULTS_ENABLED:
        return
    if fault.get("hang"):
        await asyncio.sleep(float(fault["hang"]))
    if fault.get("crash") == "before_effect":
        _kill_self()


async def after_effect(fault: dict) -> None:
    if not fault or not settings.SCRIPTED_FAULTS_ENABLED:
        return
    if fault.get("crash") == "after_effect":
        _kill_self()
    if fault.get("tool_fails"):
        raise ScriptedToolError(fault["tool_fails"])
