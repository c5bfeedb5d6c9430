"""Tool faults requested by the scripted model, delivered to the tool it calls.

The scripted model arms a fault under the function call id it emits; the tool looks it up by
`tool_context.function_call_id` and fails for real: it raises after doing its effect, hangs, or
kills its own process with SIGKILL (no `finally`, no response) before or after the effect.
"""

import asyncio
import logging
import os
import signal
import threading
from typing import Any

from django.conf import settings

from config.lib.process import is_web_process

logger = logging.getLogger(__name__)
# Faults that end the process they run in: never honoured in a web process, where they would
# take every other user's requests down with the run.
PROCESS_FAULTS = ("crash",)

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
    if is_web_process():
        logger.warning("A scripted crash was ignored: it is never honoured in a web process.")
        return
    os.kill(os.getpid(), signal.SIGKILL)


def refused_in_web_process(params: Any) -> str | None:
    """Why these params cannot run in a web process (a chat turn), or None."""
    if not isinstance(params, dict):
        return None
    scripts = [params.get("script")]
    if isinstance(params.get("scripts"), dict):
        scripts.extend(params["scripts"].values())
    for script in scripts:
        steps = script if isinstance(script, list) else []
        for step in steps:
            for call in step if isinstance(step, list) else [step]:
                if isinstance(call, dict) and any(key in call for key in PROCESS_FAULTS):
                    return (
                        "A chat turn runs in the web server's process, so a script step with a \"crash\" fault is "
                        "refused here; start it as a run (POST /api/runs/), which a worker executes."
                    )
    return None


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
