"""Who sees which runs: one rule for every door (API, admin).

Holders of `runs.view_agentrun` (superusers hold every permission) see every run; anyone else,
staff included, sees only the runs they started (and, to answer them, the runs that wait for an
answer of the owners they may act for, when they hold `runs.approve_toolcall` or `runs.answer_toolcall`): the API reads under the admin's own permission,
so `is_staff` alone, which the admin answers with 403, reads no one else's runs or events. A run someone may not see answers as if it did not exist. Seeing is not acting: who
may replay or cancel a run, and whose memories a user may read, is `runs.rules.permissions`.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db.models import Q

from runs.models.ledger import AgentRun
from runs.refusals import RunNotFound
from runs.rules import owners


def can_see_every_run(user: Any) -> bool:
    return bool(user is not None and getattr(user, "is_active", False) and user.has_perm("runs.view_agentrun"))


def visible_runs(user: Any):
    """Holders of runs.view_agentrun see every run; anyone else the runs they started, and (holding
    runs.approve_toolcall or runs.answer_toolcall) the runs that wait for an answer of the owners
    they may act for (`runs.rules.owners.deciders_runs_q`)."""
    if user is None or not getattr(user, "is_authenticated", False):
        return AgentRun.objects.none()
    if can_see_every_run(user):
        return AgentRun.objects.all()
    return AgentRun.objects.filter(Q(created_by=user) | owners.deciders_runs_q(user=user))


def get_visible_run(run_id: Any, *, actor: Any, lock: bool = False) -> AgentRun:
    """The run `actor` may see, else RunNotFound (a malformed id too).

    `lock=True` takes its row lock (`select_for_update()`), inside the caller's transaction: the
    services that decide on a run and then change it or write its successor.
    """
    runs = visible_runs(actor)
    if lock:
        runs = runs.select_for_update()
    try:
        return runs.get(pk=run_id)
    except (AgentRun.DoesNotExist, ValidationError, ValueError):
        raise RunNotFound(run_id) from None
