"""Who may place scripted tool faults, and on which runs they are honoured.

A `crash` fault kills the worker process it runs in, and every other run in flight there with
it (they are reconciled, not lost, but they fail): so a fault is honoured only where the
deployment allows faults (SCRIPTED_FAULTS_ENABLED) **and** the run's creator holds
`runs.place_tool_faults`. Starting a run with faults without the permission is refused (403);
a run that carries faults anyway (a replay by someone else) plays its script without them.
A system trigger (the command line, a schedule, a webhook source staff configured) has no
creator: the operator's settings decide, and the staff member who saved a schedule's or a source's
params needed the permission for any fault in them (`runs.admin.owners`). A run the system wrote to
continue a chain carries the chain's person, whose permission decides.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from agents.scripted import FAULT_KEYS
from runs.models.ledger import AgentRun
from runs.refusals import FaultsNotPermitted

PLACE_TOOL_FAULTS = "runs.place_tool_faults"


def may_place_faults(user: Any) -> bool:
    return user is None or not getattr(user, "is_authenticated", False) or user.has_perm(PLACE_TOOL_FAULTS)


def faults_in(value: Any) -> list[str]:
    """The fault keys any script step in `value` (a run's params) carries, each once."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "call" in node:
                found.update(FAULT_KEYS & set(node))
            for child in node.values():
                walk(child)
        elif isinstance(node, list | tuple):
            for child in node:
                walk(child)

    if isinstance(value, dict):
        walk([value.get("script"), value.get("scripts")])
    return sorted(found)


def check_may_place_faults(*, user: Any, params: Any) -> None:
    """403 `faults_not_permitted` for a person without the permission whose params carry faults."""
    if user is None or not getattr(user, "is_authenticated", False):
        return
    placed = faults_in(params)
    if placed and not may_place_faults(user):
        raise FaultsNotPermitted(placed)


def faults_honoured(run: AgentRun) -> bool:
    """Whether this run's scripted faults happen: the setting, and its creator's permission."""
    if not settings.SCRIPTED_FAULTS_ENABLED:
        return False
    return run.created_by is None or may_place_faults(run.created_by)
