"""Who may act for whom, and on whose runs: one rule for every door (docs/architecture.md, "Who may act for whom").

Every "who may" of the ledger is here: for an owner, on a run (replay, resume, cancel, force),
on a call in doubt (settle), on a webhook event (resolve).

Seeing is `runs.rules.visibility`; this module is acting.

- **For an owner** (`runs.rules.owners`). A user may start runs, chat turns and read memory for an owner
  only if the owner is their own username, or an admin granted them that owner (`OwnerGrant`), or
  they hold `runs.act_for_any_owner` (service accounts, the support desk). A system trigger (a
  schedule, a webhook event) has no actor: its owner was fixed by staff when they saved it, under
  this rule. The worker asks it again before a run goes on (`runs.rules.owners.check_may_continue`).
- **On a run.** Replaying or cancelling one's own run (`created_by` is the actor) needs no
  permission; someone else's needs `runs.replay_agentrun` / `runs.cancel_agentrun`. Forcing
  needs `runs.force_replay_agentrun` on top (`runs.services.run.check_force`). A replay starts a run
  for the original's owner, so without `runs.replay_agentrun` replaying one's own run also asks
  the owner rule again (a grant taken back stops replays too); a holder of it replays any run
  for the owner the original's starter was allowed. Resuming asks what replaying asks.
- **On a call in doubt.** Settling one needs `runs.settle_toolcall`.
- **On a call that waits.** Approving or rejecting one needs `runs.approve_toolcall` and the owner
  rule for the run's owner, and is refused to the run's starter unless APPROVAL_BY_STARTER_ALLOWED;
  giving a long-running call's result needs `runs.answer_toolcall` and the owner rule. Either
  permission with the owner rule is enough to see that owner's runs that wait (`runs.rules.visibility`).
- A run the actor cannot see answers 404 before any of this.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from memory.refusals import ScopeNotVisible
from runs.models.ledger import AgentRun
from runs.refusals import (
    AnswerNotPermitted,
    ApprovalByStarter,
    ApproveNotPermitted,
    CancelNotPermitted,
    ForceNotPermitted,
    OwnerNotPermitted,
    ReplayNotPermitted,
    ResolveNotPermitted,
    ResumeNotPermitted,
    RetryNotPermitted,
    RunNotFound,
    SettleNotPermitted,
)
from runs.rules import owners, visibility

ACT_FOR_ANY_OWNER = owners.ACT_FOR_ANY_OWNER
REPLAY_OTHERS = owners.REPLAY_OTHERS
CANCEL_OTHERS = "runs.cancel_agentrun"
RESOLVE_EVENTS = "runs.resolve_webhookevent"
FORCE_REPLAY = "runs.force_replay_agentrun"
SETTLE_CALLS = "runs.settle_toolcall"
APPROVE_CALLS = owners.APPROVE_CALLS
ANSWER_CALLS = owners.ANSWER_CALLS


_is_person = owners.is_person
may_act_for_any_owner = owners.may_act_for_any_owner
may_act_for_owner = owners.may_act_for_owner
owners_q = owners.owners_q
check_may_act_for_owner = owners.check_may_act_for_owner


def check_may_read_memory(*, user: Any, agent: str, owner_id: str) -> None:
    """An owner's memories are read under the owner rule; refused as if the scope did not exist."""
    if not may_act_for_owner(user=user, owner_id=owner_id):
        # The same answer whether the scope is empty, unknown or someone else's.
        raise ScopeNotVisible(f"No memories of agent {agent!r} for owner {owner_id!r} are visible to you.")


# --- On a run -------------------------------------------------------------------------------------


def is_own_run(*, actor: Any, run: AgentRun) -> bool:
    return _is_person(actor) and run.created_by_id is not None and run.created_by_id == actor.pk


def may_replay_others(*, user: Any) -> bool:
    return _is_person(user) and user.has_perm(REPLAY_OTHERS)


def may_cancel_others(*, user: Any) -> bool:
    return _is_person(user) and user.has_perm(CANCEL_OTHERS)


def may_resolve_events(*, user: Any) -> bool:
    return _is_person(user) and user.has_perm(RESOLVE_EVENTS)


def has_own_runs(*, user: Any) -> bool:
    """Whether `user` started any run: they may replay or cancel those without a permission."""
    return _is_person(user) and AgentRun.objects.filter(created_by=user).exists()


def _check_visible(*, actor: Any, run: AgentRun) -> None:
    if not _is_person(actor):
        raise RunNotFound(run.run_id)
    if visibility.can_see_every_run(actor) or run.created_by_id == actor.pk:
        return
    if not visibility.visible_runs(actor).filter(pk=run.pk).exists():
        raise RunNotFound(run.run_id)


def check_may_replay(*, actor: Any, run: AgentRun) -> None:
    """Raises RunNotFound (cannot see it), ReplayNotPermitted (someone else's) or OwnerNotPermitted.

    OwnerNotPermitted: the actor's own run, for an owner they may no longer act for.
    """
    _check_visible(actor=actor, run=run)
    if may_replay_others(user=actor):
        return
    if not is_own_run(actor=actor, run=run):
        raise ReplayNotPermitted(run.run_id)
    check_may_act_for_owner(user=actor, owner_id=run.owner_id)


def check_may_cancel(*, actor: Any, run: AgentRun) -> None:
    """Raises RunNotFound (cannot see it) or CancelNotPermitted (someone else's, without the permission)."""
    _check_visible(actor=actor, run=run)
    if not is_own_run(actor=actor, run=run) and not may_cancel_others(user=actor):
        raise CancelNotPermitted(run.run_id)


def check_may_resume(*, actor: Any, run: AgentRun) -> None:
    """As for replay: the run's creator, while they may still act for its owner, or a holder of
    `runs.replay_agentrun`; a run the actor cannot see is not found."""
    try:
        check_may_replay(actor=actor, run=run)
    except ReplayNotPermitted:
        raise ResumeNotPermitted() from None


def may_resume(*, actor: Any, run: AgentRun) -> bool:
    try:
        check_may_resume(actor=actor, run=run)
    except (ResumeNotPermitted, OwnerNotPermitted, RunNotFound):
        return False
    return True


def may_force_replay(*, user: Any) -> bool:
    return user is not None and user.has_perm(FORCE_REPLAY)


def check_may_force(*, actor: Any) -> None:
    if not may_force_replay(user=actor):
        raise ForceNotPermitted()


# --- On a call in doubt ---------------------------------------------------------------------------


def may_settle(*, user: Any) -> bool:
    return user is not None and user.has_perm(SETTLE_CALLS)


def check_may_settle(*, actor: Any) -> None:
    if not may_settle(user=actor):
        raise SettleNotPermitted()


# --- On a call that waits (runs.ledger.approvals) ---------------------------------------------------------


def may_approve(*, user: Any, run: AgentRun | None = None) -> bool:
    """The permission, and (given the run) the owner rule for its owner."""
    if not (_is_person(user) and user.has_perm(APPROVE_CALLS)):
        return False
    return run is None or may_act_for_owner(user=user, owner_id=run.owner_id)


def check_may_approve(*, actor: Any, run: AgentRun | None = None) -> None:
    """A decision: `runs.approve_toolcall`, then (given the run) the owner rule for its owner, then
    a second person unless APPROVAL_BY_STARTER_ALLOWED (`require_confirmation` stands for one)."""
    if not may_approve(user=actor):
        raise ApproveNotPermitted()
    if run is not None:
        check_may_act_for_owner(user=actor, owner_id=run.owner_id)
        if not settings.APPROVAL_BY_STARTER_ALLOWED and is_own_run(actor=actor, run=run):
            raise ApprovalByStarter(run.run_id)


def may_decide_on(*, user: Any, run: AgentRun) -> bool:
    """Whether a decision on `run`'s calls would be taken (the run page offers the form only then)."""
    try:
        check_may_approve(actor=user, run=run)
    except (ApproveNotPermitted, OwnerNotPermitted, ApprovalByStarter):
        return False
    return True


def may_answer(*, user: Any, run: AgentRun | None = None) -> bool:
    if not (_is_person(user) and user.has_perm(ANSWER_CALLS)):
        return False
    return run is None or may_act_for_owner(user=user, owner_id=run.owner_id)


def check_may_answer(*, actor: Any, run: AgentRun | None = None) -> None:
    """A long-running call's result: the permission, then (given the run) the owner rule for its owner."""
    if not may_answer(user=actor):
        raise AnswerNotPermitted()
    if run is not None:
        check_may_act_for_owner(user=actor, owner_id=run.owner_id)


# --- On a webhook event ---------------------------------------------------------------------------


def check_may_retry_events(*, actor: Any) -> None:
    """Processing an event again replays a run nobody in particular started: `runs.replay_agentrun`."""
    if not may_replay_others(user=actor):
        raise RetryNotPermitted()


def check_may_resolve_events(*, actor: Any) -> None:
    if not may_resolve_events(user=actor):
        raise ResolveNotPermitted()
