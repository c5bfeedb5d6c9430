"""Starting, replaying and cancelling runs. Views, admin actions, commands and tasks all call these functions.

A run's life in its worker (claim, heartbeat, settle) is in `runs.ledger.lifecycle`; who may see a run is
`runs.rules.visibility`, who may act for an owner or on a run is `runs.rules.permissions`; what a run called
is the journal's evidence (`runs.ledger.journal`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from config.lib import files
from config.lib.refusals import TooLargeInput, required_text
from config.lib.text import hidden_character
from runs.inputs.run_input import clean_file_name, input_errors
from runs.ledger import approvals, journal, lifecycle, reconcile
from runs.ledger.counters import REPLAY_REFUSALS
from runs.models.chat import Conversation
from runs.models.ledger import STREAMED_TRIGGERS, AgentRun, EffectsChoice, RunStatus, Trigger
from runs.refusals import (
    ReasonHasHiddenCharacters,
    ReasonRequired,
    ReasonTooLong,
    RedoNeedsForce,
    RunAlreadySettled,
    UnknownEffectsChoice,
)
from runs.rules import permissions, quotas, visibility
from runs.rules import replay as rules
from runs.rules import resume as resume_rules
from runs.rules.faults import check_may_place_faults

logger = logging.getLogger(__name__)

_COPY_CHUNK = 1024 * 1024


# --- Starting a run -------------------------------------------------------------------------------


def _copy_input_file(source: IO[bytes], destination: Path) -> tuple[str, int]:
    """Copy, hashing as we go; stop as soon as the size limit is passed."""
    limit = settings.MAX_UPLOAD_BYTES
    digest = hashlib.sha256()
    size = 0
    files.make_private_dir(destination.parent)
    partial = destination.with_name(destination.name + ".partial")
    with files.open_private(partial) as out:
        while chunk := source.read(_COPY_CHUNK):
            size += len(chunk)
            if size > limit:
                raise TooLargeInput(
                    {"file": f"The file is larger than the limit of {limit} bytes (MAX_UPLOAD_BYTES)."}, limit=limit
                )
            digest.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    partial.rename(destination)
    return digest.hexdigest(), size


def run_inputs_dir(run_id: uuid.UUID) -> Path:
    return Path(settings.RUN_INPUTS_DIR) / str(run_id)


def start_run(
    *,
    agent_name: str,
    message: str,
    owner_id: str,
    params: dict | None = None,
    file: IO[bytes] | None = None,
    file_name: str | None = None,
    created_by: Any = None,
    trigger: str = Trigger.API,
    conversation_id: str = "",
    session_id: str | None = None,
    enqueue: bool = True,
) -> AgentRun:
    """Validate, copy the input file, write the run as `queued` (claimable), and tell the workers at the commit.

    `enqueue=False` writes it without telling the workers: for a caller that claims and runs it
    itself at once (`run_agent --inline`, a webhook event's worker, the demo's seeding). The row is
    claimable all the same; a worker polling may take it first, and the caller's claim then finds
    nothing (it waits for the run instead).

    `created_by` is the person starting the run, and the owner rule applies to them
    (`runs.rules.permissions`: 403 `owner_not_permitted`). None is a system trigger (a schedule, a
    webhook event, the command line) whose owner staff fixed: the rule was applied when it was saved.

    `agent_name` names a registered agent or a workflow. A workflow run stores a snapshot of its
    graph in `config["workflow"]`, so it and its replays run the graph as it was when written;
    started from the API (the default trigger) its trigger is `workflow`.

    Raises ValidationError (a dict of field errors) for bad input; nothing is written then.
    """
    cleaned, errors = input_errors(agent_name=agent_name, message=message, owner_id=owner_id, params=params)
    if file is not None:
        try:
            cleaned["file_name"] = clean_file_name(file_name if file_name is not None else getattr(file, "name", ""))
        except ValidationError as exc:
            errors.setdefault("file", []).extend(exc.message_dict["file"])
    if errors:
        raise ValidationError(errors)
    if created_by is not None:
        permissions.check_may_act_for_owner(user=created_by, owner_id=cleaned["owner_id"])
        check_may_place_faults(user=created_by, params=cleaned["params"])
    target = cleaned["agent"]
    config: dict[str, Any] = {"message": cleaned["message"], "params": cleaned["params"]}
    if isinstance(target, dict):
        config["workflow"] = target
        target_name = target["name"]
        if trigger == Trigger.API:
            trigger = Trigger.WORKFLOW
    else:
        target_name = target.name

    run_id = uuid.uuid4()
    stored_path = ""
    sha256, size = "", None
    if file is not None:
        # The name on disk fits the file system; the user's name is kept whole in input_file_name.
        destination = run_inputs_dir(run_id) / files.disk_name(cleaned["file_name"])
        try:
            sha256, size = _copy_input_file(file, destination)
        except BaseException:
            shutil.rmtree(run_inputs_dir(run_id), ignore_errors=True)
            raise
        stored_path = str(destination)

    try:
        with transaction.atomic():
            run = write_queued_run(
                actor=created_by,
                chat=trigger in STREAMED_TRIGGERS,
                enqueue=enqueue,
                run_id=run_id,
                trigger=trigger,
                agent_name=target_name,
                owner_id=cleaned["owner_id"],
                config=config,
                input_file=stored_path,
                input_file_name=cleaned.get("file_name", ""),
                input_file_sha256=sha256,
                input_file_size=size,
                session_id=session_id or str(uuid.uuid4()),
                conversation_id=conversation_id,
            )
    except BaseException:
        if stored_path:
            shutil.rmtree(run_inputs_dir(run_id), ignore_errors=True)
        raise
    return run


def write_queued_run(
    *, actor: Any, chat: bool = False, enqueue: bool = True, on_behalf_of: Any = None, **fields: Any
) -> AgentRun:
    """Write a run `queued` and tell the workers at the commit, inside the caller's transaction: the one writer
    of new runs (`start_run`, and a replay's or resume's `AgentRun.successor_fields`).

    The run counts against `actor`'s cap of work in flight (`runs.rules.quotas`), is `created_by` them
    when they are a person, and carries its agent's fingerprint now unless `fields` give one.
    The system (`actor` None) continuing a chain passes the chain's person as `on_behalf_of`: the run
    is theirs (`created_by`, counted in their cap from now on, seen and cancelled by them) and marked
    `continued_by_system`; it replaces a run that died, so it is not refused by the cap.
    """
    if actor is None and on_behalf_of is not None:
        fields["created_by"], fields["continued_by_system"] = on_behalf_of, True
        return _write(enqueue=enqueue, fields=fields)
    quotas.check_in_flight(user=actor, chat=chat)
    fields["created_by"] = actor if getattr(actor, "is_authenticated", False) else None
    if actor is None:
        fields["continued_by_system"] = bool(fields.get("resume_reason"))
    return _write(enqueue=enqueue, fields=fields)


def _write(*, enqueue: bool, fields: dict[str, Any]) -> AgentRun:
    if "agent_fingerprint" not in fields:
        fields["agent_fingerprint"] = resume_rules.current_fingerprint(
            agent_name=fields["agent_name"], workflow=(fields.get("config") or {}).get("workflow") or None
        )
    run = AgentRun.objects.create(**fields)
    if enqueue:
        # In the same transaction: the workers are told when (and only if) the row commits.
        lifecycle.announce_run(run.run_id)
    return run


# --- Replaying ------------------------------------------------------------------------------------

MAX_FORCE_REASON_CHARS = 2000


def check_force_reason(reason: Any) -> str:
    """The one rule for a force's reason, for every door: given, and not too long. Returns it cleaned."""
    text = required_text(reason, limit=MAX_FORCE_REASON_CHARS, missing=ReasonRequired, too_long=ReasonTooLong)
    # Kept in the audit log for the next person, as a settle note is: the same rule.
    if (problem := hidden_character(text)) is not None:
        raise ReasonHasHiddenCharacters(problem)
    return text


def check_force(*, actor: Any, reason: Any) -> str:
    """May `actor` force, and did they say why? Returns the cleaned reason; raises the refusal otherwise."""
    permissions.check_may_force(actor=actor)
    return check_force_reason(reason)


def _log_forced_replay(*, actor: Any, original: AgentRun, replay: AgentRun, overridden: str, reason: str) -> None:
    choice = EffectsChoice(replay.effects).label
    LogEntry.objects.log_actions(
        actor.pk,
        [replay],
        ADDITION,
        f"Forced replay of run {original.run_id}, overriding “{overridden}”, effects: {choice}. Reason: {reason}",
        single_object=True,
    )
    LogEntry.objects.log_actions(
        actor.pk,
        [original],
        CHANGE,
        f"Force-replayed as run {replay.run_id}, overriding “{overridden}”, effects: {choice}. Reason: {reason}",
        single_object=True,
    )


def check_effects_choice(*, effects: Any, force: bool) -> str:
    """reuse (the default: a done effect is served from its record) or redo (new keys; forced only)."""
    if effects not in EffectsChoice.values:
        raise UnknownEffectsChoice(effects)
    if effects == EffectsChoice.REDO and not force:
        raise RedoNeedsForce()
    return effects


def replay_run(
    run_id: Any, *, actor: Any, force: bool = False, reason: str = "", effects: str = EffectsChoice.REUSE
) -> AgentRun:
    """Replay a settled run as a new run, if `runs.rules.replay.decide` allows it; else raise its refusal.

    `effects` is a forced replay's choice, recorded on the new run: `reuse` keeps the original's
    intent, so effects it recorded as done are served from their records instead of happening
    again; `redo` starts a new intent, so they happen again (docs/architecture.md, "Effects").

    The original row is locked while deciding, so simultaneous requests for one run create at
    most one replay: the second waits, then sees the first one's replay in flight. (On SQLite,
    IMMEDIATE transactions serialise the same way.)
    """
    effects = check_effects_choice(effects=effects, force=force)
    if force:
        reason = check_force(actor=actor, reason=reason)

    with transaction.atomic():
        original = visibility.get_visible_run(run_id, actor=actor, lock=True)
        permissions.check_may_replay(actor=actor, run=original)
        # A run whose worker died is judged as what it is (a failure with unknown outcome), not
        # as "still running".
        reconcile.reconcile_run_if_stale(original)
        decision = rules.decide(original, force=force, facts=rules.gather_facts(original, verify_digest=True))
        if decision.refusal is not None:
            REPLAY_REFUSALS.labels(code=decision.refusal.code).inc()
            raise decision.refusal
        forced = decision.overridden is not None
        replay = write_queued_run(
            actor=actor,
            **original.successor_fields(),
            replay_of=original,
            forced=forced,
            forced_by=actor if forced else None,
            force_reason=reason if forced else "",
            effects=effects,
            session_id=str(uuid.uuid4()),
        )
        if forced:
            _log_forced_replay(
                actor=actor, original=original, replay=replay, overridden=decision.overridden.code, reason=reason
            )
    logger.info("Run %s replayed as %s (forced=%s) by %s", original.run_id, replay.run_id, forced, actor)
    return replay


def resume_run(run_id: Any, *, actor: Any) -> AgentRun:
    """Continue a failed run in its session as a new run, if `decide_resume` allows it; else raise its refusal.

    The original row is locked while deciding, so simultaneous requests for one run create one
    resume: the second waits, then sees the first one's resume as the run's successor.
    """
    with transaction.atomic():
        original = visibility.get_visible_run(run_id, actor=actor, lock=True)
        permissions.check_may_resume(actor=actor, run=original)
        if original.conversation_id:
            # The lock a chat's next turn takes (runs.chat.turns.begin_turn): a turn and a resume
            # started at once are serialised, and the second sees the first in the session.
            list(Conversation.objects.select_for_update().filter(pk=original.conversation_id).values_list("pk"))
        reconcile.reconcile_run_if_stale(original)
        facts = resume_rules.gather_resume_facts(original)
        decision = resume_rules.decide_resume(original, facts=facts)
        if decision.refusal is not None:
            raise decision.refusal
        resumed = write_queued_run(
            actor=actor,
            **original.successor_fields(),
            resume_of=original,
            session_id=original.session_id,
            conversation_id=original.conversation_id,
            agent_fingerprint=facts.fingerprint_now,
        )
    logger.info("Run %s resumed as %s by %s", original.run_id, resumed.run_id, actor)
    return resumed


# --- Cancelling -----------------------------------------------------------------------------------

CANCELLED_BEFORE_START = "The run was cancelled before it started."
CANCELLED_BEFORE_GOING_ON = "The run was cancelled after its calls were answered, before it went on."


def cancel_run(run_id: Any, *, actor: Any) -> AgentRun:
    """Cancel a run: a queued one never starts; a running one is asked to stop.

    A running run's heartbeat sees `cancel_requested_at` within one beat and aborts the ADK
    invocation, which seals pending calls; the run then settles `cancelled` with its tools.
    Cancelling twice is harmless; cancelling a settled run is refused.
    """
    now = timezone.now()
    user = actor if getattr(actor, "is_authenticated", False) else None
    with transaction.atomic():
        run = visibility.get_visible_run(run_id, actor=actor, lock=True)
        permissions.check_may_cancel(actor=actor, run=run)
        # Nobody is left to act on a dead run's cancellation: settle it as what it is instead.
        reconcile.reconcile_run_if_stale(run)
        if run.status == RunStatus.QUEUED:
            # Conditional on `queued`, so a claim that slipped in first turns this into the
            # running case below instead of being overwritten.
            cancelled = AgentRun.objects.filter(pk=run.pk, status=RunStatus.QUEUED).update(
                status=RunStatus.CANCELLED,
                # A run queued again after it waited has already called tools.
                tools_executed=[] if run.attempts == 0 else journal.derive_tools_executed(run),
                error_code="cancelled",
                error_message=CANCELLED_BEFORE_START if run.attempts == 0 else CANCELLED_BEFORE_GOING_ON,
                finished_at=now,
                cancel_requested_at=now,
                cancel_requested_by=user,
            )
            if not cancelled:
                run.refresh_from_db()
        if run.status == RunStatus.WAITING:
            # No worker holds a waiting run: it is settled here, and the calls it waited for are closed.
            approvals.cancel_waiting(run=run, actor=actor, now=now)
            run.refresh_from_db()
            return run
        if run.status == RunStatus.RUNNING:
            AgentRun.objects.filter(pk=run.pk, status=RunStatus.RUNNING, cancel_requested_at__isnull=True).update(
                cancel_requested_at=now, cancel_requested_by=user
            )
        elif run.status != RunStatus.QUEUED:
            raise RunAlreadySettled(run.status)
    run.refresh_from_db()
    return run
