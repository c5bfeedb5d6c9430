"""Who sees which runs, and which memories: one rule for every door (API, admin, memory search).

Staff and holders of `runs.view_agentrun` see every run; anyone else sees only the runs they
started, and an owner's memories of an agent only if they started a run of it for that owner.
A run (or a scope) someone may not see answers as if it did not exist.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError

from memory.refusals import ScopeNotVisible
from runs.models import AgentRun
from runs.refusals import RunNotFound


def can_see_every_run(user: Any) -> bool:
    return bool(getattr(user, "is_staff", False) or (user is not None and user.has_perm("runs.view_agentrun")))


def visible_runs(user: Any):
    """Staff and holders of runs.view_agentrun see every run; anyone else only the runs they started."""
    if user is None or not getattr(user, "is_authenticated", False):
        return AgentRun.objects.none()
    if can_see_every_run(user):
        return AgentRun.objects.all()
    return AgentRun.objects.filter(created_by=user)


def get_visible_run(run_id: Any, *, actor: Any) -> AgentRun:
    try:
        return visible_runs(actor).get(pk=run_id)
    except (AgentRun.DoesNotExist, ValidationError, ValueError):
        raise RunNotFound(run_id) from None


def can_see_scope(*, user: Any, agent: str, owner_id: str) -> bool:
    """The runs' visibility rule applied to one (agent, owner) scope of memories."""
    if user is None or not user.is_authenticated or not user.is_active:
        return False
    if can_see_every_run(user):
        return True
    return AgentRun.objects.filter(agent_name=agent, owner_id=owner_id, created_by=user).exists()


def check_scope_visible(*, user: Any, agent: str, owner_id: str) -> None:
    if not can_see_scope(user=user, agent=agent, owner_id=owner_id):
        # The same answer whether the scope is empty, unknown or someone else's.
        raise ScopeNotVisible(f"No memories of agent {agent!r} for owner {owner_id!r} are visible to you.")
