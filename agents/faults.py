"""Tool faults requested by the scripted model, delivered at the tool boundary of any tool.

The scripted model arms a fault under the function call id it emits. Two plugins around the
effects plugin deliver it to whatever tool the call reaches (a package's own function, an MCP
server's tool, a bundled tool), for real: the process kills itself with SIGKILL (no `finally`, no
response) before the tool acts or after it acted, the call hangs, or it fails after its effect.

    [..., ToolFaultsAfter, EffectsPlugin, ToolFaultsBefore]

ADK runs plugins' before-tool callbacks in order, then the tool, then their after-tool callbacks
in the same order, so "before" runs once the effect record is claimed (as if the tool died as it
began) and "after" runs before the record is marked done (as if it died just after acting). A
call answered without running its tool (served from its effect record), or whose tool only asks
for a confirmation (or was rejected), gets no fault.

Faults are honoured only where the deployment allows them (SCRIPTED_FAULTS_ENABLED) and the run's
creator may place them (`runs.place_tool_faults`); otherwise an armed fault is taken and dropped.
"""

import asyncio
import logging
import os
import signal
import threading
from typing import Any

from django.conf import settings
from google.adk.plugins.base_plugin import BasePlugin

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


class _Stage:
    """What the two plugins of one run share: the faults taken for calls whose tool runs."""

    def __init__(self, *, honoured: bool) -> None:
        self.honoured = honoured
        self.taken: dict[str, dict] = {}
        self.ran: set[str] = set()


async def _only_asks(tool: Any, tool_args: dict, tool_context: Any) -> bool:
    """True when the tool will not run its function now: it asks for a confirmation first
    (`require_confirmation`), or a person rejected the call. The fault waits, armed, for the
    attempt that runs it (an approved call's later attempt arms it again, `runs.ledger.approvals`)."""
    confirmation = tool_context.tool_confirmation
    if confirmation is not None:
        return not confirmation.confirmed
    check = getattr(tool, "check_require_confirmation", None)
    if check is None:
        return False
    try:
        return bool(await check(tool_args, tool_context))
    except Exception:  # noqa: BLE001 - the tool itself will say what is wrong with its arguments
        return False


class ToolFaultsAfter(BasePlugin):
    """Placed before the effects plugin: takes each call's fault; after the tool, crash or fail."""

    def __init__(self, stage: _Stage) -> None:
        super().__init__(name="agent_ledger_tool_faults_after")
        self.stage = stage

    async def before_tool_callback(self, *, tool, tool_args, tool_context):
        call_id = tool_context.function_call_id or ""
        if await _only_asks(tool, tool_args, tool_context):
            return None
        fault = take(call_id)
        if fault and self.stage.honoured:
            self.stage.taken[call_id] = fault
        return None

    async def after_tool_callback(self, *, tool, tool_args, tool_context, result):
        call_id = tool_context.function_call_id or ""
        fault = self.stage.taken.pop(call_id, {})
        if call_id not in self.stage.ran:
            return None  # answered without running the tool: nothing befell it
        self.stage.ran.discard(call_id)
        try:
            await after_effect(fault)
        except ScriptedToolError as error:
            # As if the tool itself had raised: every plugin hears of it (the journal marks the
            # call failed, the effect record keeps the error) before the run fails with it.
            await tool_context._invocation_context.plugin_manager.run_on_tool_error_callback(
                tool=tool, tool_args=tool_args, tool_context=tool_context, error=error
            )
            raise
        return None


class ToolFaultsBefore(BasePlugin):
    """Placed after the effects plugin: reached only when the tool is about to run; hang or crash."""

    def __init__(self, stage: _Stage) -> None:
        super().__init__(name="agent_ledger_tool_faults_before")
        self.stage = stage

    async def before_tool_callback(self, *, tool, tool_args, tool_context):
        call_id = tool_context.function_call_id or ""
        self.stage.ran.add(call_id)
        await before_effect(self.stage.taken.get(call_id, {}))
        return None


def around_effects(effects_plugin: BasePlugin, *, honoured: bool) -> list[BasePlugin]:
    """The effects plugin with the fault plugins either side (see the module's docstring)."""
    stage = _Stage(honoured=honoured)
    return [ToolFaultsAfter(stage), effects_plugin, ToolFaultsBefore(stage)]
