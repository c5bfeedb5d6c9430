"""The owner rule: for which owners a person may act (docs/architecture.md, "Who may act for whom").

Asked at every door that starts or answers work for an owner, and asked again when a worker
continues a run.

A user may act for an owner if the owner is their own username, or an admin granted them that
owner (`OwnerGrant`), or they hold `runs.act_for_any_owner`. A grant taken back takes effect at
once: the next door refuses, and so does the worker about to continue a run that was started or
answered under it (`check_may_continue`).
"""

from __future__ import annotations

from typing import Any

from django.db.models import Q

from runs.models.approvals import PendingCall
from runs.models.ledger import AgentRun
from runs.models.owners import OwnerGrant
from runs.refusals import OwnerNotPermitted

ACT_FOR_ANY_OWNER = "runs.act_for_any_owner"
REPLAY_OTHERS = "runs.replay_agentrun"
APPROVE_CALLS = "runs.approve_toolcall"
ANSWER_CALLS = "runs.answer_toolcall"


def is_person(user: Any) -> bool:
    return bool(user is not None and getattr(user, "is_authenticated", False) and getattr(user, "is_active", False))


def may_act_for_any_owner(*, user: Any) -> bool:
    return is_person(user) and user.has_perm(ACT_FOR_ANY_OWNER)


def may_act_for_owner(*, user: Any, owner_id: str) -> bool:
    """May `user` start runs, chat turns, answer calls and read memory for `owner_id` (a cleaned owner id)?"""
    if not is_person(user) or not isinstance(owner_id, str) or not owner_id:
        return False
    if owner_id == user.get_username() or user.has_perm(ACT_FOR_ANY_OWNER):
        return True
    return OwnerGrant.objects.filter(user=user, owner_id=owner_id).exists()


def owners_q(*, user: Any, field: str = "owner_id") -> Q:
    """The owners `user` may act for, as a filter on `field`: the owner rule for a whole list."""
    if not is_person(user):
        return Q(pk__in=[])
    if user.has_perm(ACT_FOR_ANY_OWNER):
        return Q()
    granted = OwnerGrant.objects.filter(user=user).values("owner_id")
    return Q(**{field: user.get_username()}) | Q(**{f"{field}__in": granted})


def check_may_act_for_owner(*, user: Any, owner_id: str) -> None:
    if not may_act_for_owner(user=user, owner_id=owner_id):
        raise OwnerNotPermitted(owner_id)


# --- Those who answer waiting calls ---------------------------------------------------------------


def deciders_runs_q(*, user: Any) -> Q:
    """The runs a holder of `runs.approve_toolcall` or `runs.answer_toolcall` sees without seeing every
    run: those that asked for an answer (they have waiting calls, open or answered), of the owners the
    holder may act for. Deciding needs reading the call and its run; nothing more is opened."""
    if not is_person(user) or not (user.has_perm(APPROVE_CALLS) or user.has_perm(ANSWER_CALLS)):
        return Q(pk__in=[])
    return owners_q(user=user) & Q(pk__in=PendingCall.objects.values("run_id"))


# --- A run going on ------------------------------------------------------------------------------


def is_continuation(run: AgentRun) -> bool:
    """A run a worker takes up again without its person at a door: after it waited for answers
    (claimed a second time), or a successor the system wrote after a death."""
    return run.attempts > 1 or bool(run.continued_by_system)


def may_continue(run: AgentRun) -> bool:
    """Whether the person a run acts under may still act for its owner.

    The person is the run's `created_by` (a system continuation carries the chain's person). No
    person is a system trigger (a schedule, a webhook source) whose owner staff fixed. A replay or
    resume by a holder of `runs.replay_agentrun` was allowed for any owner at its door, so it is here.
    """
    person = run.created_by
    if person is None:
        return True
    if may_act_for_owner(user=person, owner_id=run.owner_id):
        return True
    successor = run.replay_of_id is not None or run.resume_of_id is not None
    return successor and is_person(person) and person.has_perm(REPLAY_OTHERS)


def no_longer_permitted(run: AgentRun) -> str:
    """The refused continuation's words (the run's error message)."""
    return (
        f"Not continued: the person this run acts under may no longer act for owner {run.owner_id!r} "
        "(their owner grant was taken back), so nothing more was done for that owner."
    )


def check_may_continue(run: AgentRun) -> None:
    """Raises OwnerNotPermitted when the run's person may no longer act for its owner."""
    if not may_continue(run):
        raise OwnerNotPermitted(run.owner_id)
