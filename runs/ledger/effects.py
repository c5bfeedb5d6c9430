"""Effects at call time: idempotency keys from stable intent, effect records, which calls are in doubt.

The tools declare their effect class where they are written (`agents.effects`). This module
reads it from the tool object ADK is about to run, whatever the agent tree, and acts on it:

- `EffectsPlugin.on_event_callback` stamps each function call's effect class into its event
  before ADK stores it, so the journal row written with the event (`runs.ledger.journal`) records the
  class as it was at call time, even if the worker dies before the tool starts.
- `EffectsPlugin.before_tool_callback`, for an idempotent tool, builds the call's key from the
  run's intent, the tool and the declared business key, and writes the `ToolEffect` record
  (`started`) in its own committed transaction *before* the tool acts. A key already `done` is
  served its recorded result without running the tool; a key `started` and never finished is in
  doubt: the tool is not run again and the run fails `effect_in_doubt`; a key used with other
  stable fields is refused to the model.
- `after_tool_callback` marks the record `done` with the result. A tool that raised leaves its
  record `started` (with the error noted): it may have acted before raising (unknown is not
  none), so only a person may say it did not.

A person's word on a call in doubt is `runs.services.decisions.settle_call` (docs/architecture.md,
"Effects"); it reads `owned_record` and `doubt_of` here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from google.adk.plugins.base_plugin import BasePlugin
from sqlalchemy.exc import DBAPIError

from agents.adk import session_service
from agents.effects import IDEMPOTENT, KeyArgumentMissing, effect_of_call_name, effect_of_tool, tool_name
from runs.ledger import chain, leases
from runs.ledger.journal import EFFECTS_METADATA_KEY, json_safe
from runs.models.effects import EffectStatus, ToolEffect
from runs.models.inbox import WebhookEvent
from runs.models.ledger import AgentRun, EffectsChoice, ToolCall, ToolCallStatus

logger = logging.getLogger(__name__)

SUMMARY_MAX_CHARS = 500


class EffectInDoubt(RuntimeError):
    """A call's effect was started before and never recorded as finished: it is not done again."""

    def __init__(self, message: str, *, call_id: str, tool_name: str):
        super().__init__(message)
        self.call_id = call_id
        self.tool_name = tool_name


def effect_in_doubt_of(exc: BaseException | None) -> EffectInDoubt | None:
    """The EffectInDoubt behind an exception ADK re-raised (a plugin's error is wrapped in a RuntimeError)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, EffectInDoubt):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


# --- Keys from stable intent -------------------------------------------------------------------------


def intent_id(run: AgentRun) -> str:
    """The intent a run carries out: the same for a run and every replay that reuses its effects.

    Up the `replay_of` / `resume_of` chain to its root, stopping at a run that chose to redo the effects (it
    starts an intent of its own). A webhook run's intent is its event (source and provider
    message id), so the event's attempts share one; any other root's is its own run id.
    """
    # A resume continues its original's intent like a replay that reuses effects.
    current = chain.root_of(
        run,
        until=lambda step: step.effects == EffectsChoice.REDO,
        fields=("run_id", "replay_of_id", "resume_of_id", "effects", "webhook_event_id"),
    )
    if current.effects != EffectsChoice.REDO and current.webhook_event_id is not None:
        source_id, external_id = WebhookEvent.objects.values_list("source_id", "external_id").get(
            pk=current.webhook_event_id
        )
        return f"webhook:{source_id}:{external_id}"
    return f"run:{current.run_id}"


def root_intent_id(run: AgentRun) -> str | None:
    """`intent_id` of a run that replays, resumes and answers nothing (read from the row already
    loaded, no query), or None when the chain or the webhook must be read."""
    if run.replay_of_id is None and run.resume_of_id is None and run.webhook_event_id is None:
        return f"run:{run.run_id}"
    return None


def effect_key(*, intent: str, tool: str, business_key: Any) -> str:
    """Never the model's whole arguments, never its call id: those change when the run is done again."""
    canonical = json.dumps([intent, tool, business_key], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


# --- The record, claimed before the tool acts ------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """What the call may do: `run` (it owns a fresh record), `served`, `refused` or `in_doubt`."""

    kind: str
    key: str
    result: Any = None
    message: str = ""


def _describe_key(effect: ToolEffect) -> str:
    return f"{effect.tool_name} for {json.dumps(effect.business_key, ensure_ascii=False)}"


def new_record(
    *, run_id: uuid.UUID, call_id: str, intent: str, tool: str, business_key: Any, stable_fields: dict
) -> dict[str, Any]:
    """The fields of a call's fresh effect record (`started`, now)."""
    return {
        "intent_id": intent[:320],
        "tool_name": tool,
        "business_key": business_key,
        "stable_fields": stable_fields,
        "first_run_id": run_id,
        "first_call_id": call_id,
        "started_at": timezone.now(),
    }


def claim_effect(
    *,
    run_id: uuid.UUID,
    call_id: str,
    intent: str,
    tool: str,
    business_key: Any,
    stable_fields: dict,
    lease: uuid.UUID | None = None,
    own_claim_may_exist: bool = False,
) -> Claim:
    """Write the record `started`, or say why the call must not run; committed when this returns.

    Only while `lease` holds the run (`runs.ledger.leases`): a worker that lost its run never starts
    an effect for it. `own_claim_may_exist`: this call's claim was sent on a connection that broke
    before it answered, so a `started` record of this run and call is that claim, not a doubt.
    """
    key = effect_key(intent=intent, tool=tool, business_key=business_key)
    record = new_record(
        run_id=run_id, call_id=call_id, intent=intent, tool=tool, business_key=business_key, stable_fields=stable_fields
    )
    now = record["started_at"]
    if connection.vendor == "postgresql" and _claim_new_key(key=key, record=record, lease=lease):
        return Claim("run", key)
    # A key with a record already (a repeat, a replay), or SQLite: read the record and decide.
    with transaction.atomic():
        leases.hold(run_id=run_id, lease=lease, what="an effect record")
        effect, created = ToolEffect.objects.get_or_create(key=key, defaults=record)
        if not created and effect.status == EffectStatus.FAILED:
            # Known not to have acted (a person said so): this call takes the record over, once,
            # with its own stable fields (nothing was done under the old ones).
            taken = ToolEffect.objects.filter(pk=effect.pk, status=EffectStatus.FAILED).update(
                status=EffectStatus.STARTED, first_run_id=run_id, first_call_id=call_id, started_at=now,
                finished_at=None, result=None, error="", stable_fields=stable_fields,
            )
            created = taken == 1
            if not created:
                effect.refresh_from_db()
        journal = ToolCall.objects.filter(run_id=run_id, call_id=call_id)
        if created:
            journal.update(effect_key=key)
            return Claim("run", key)
        if effect.stable_fields != stable_fields:
            message = (
                f"Not done: {_describe_key(effect)} was already done in this request with "
                f"{json.dumps(effect.stable_fields, ensure_ascii=False)}, and this call asks for "
                f"{json.dumps(stable_fields, ensure_ascii=False)}. Doing it again could repeat it; "
                "a person can replay the run and choose to redo its effects."
            )
            journal.update(effect_key=key, status=ToolCallStatus.REFUSED)
            return Claim("refused", key, message=message)
        if effect.status == EffectStatus.DONE:
            journal.update(effect_key=key, status=ToolCallStatus.DEDUPLICATED)
            result = effect.result if isinstance(effect.result, dict) else {"result": effect.result}
            return Claim("served", key, result=result)
        if own_claim_may_exist and effect.status == EffectStatus.STARTED and (
            (effect.first_run_id, effect.first_call_id) == (run_id, call_id)
        ):
            # This very call's own claim, committed by an attempt whose answer was lost with its
            # connection (a call id is unique in its run): it is this call's record.
            journal.update(effect_key=key)
            return Claim("run", key)
        in_flight = AgentRun.objects.filter(pk=effect.first_run_id, status__in=["queued", "running"]).exists()
        message = (
            f"{_describe_key(effect)} was started by run {effect.first_run_id} (call {effect.first_call_id}) "
            + (
                "and is still being done there"
                if in_flight
                else "and never recorded as finished, so it is unknown whether it happened"
            )
            + ". It was not done again: a person must settle that call (done or not done) before a replay "
            "can go on, or replay with the effects redone."
        )
        journal.update(
            effect_key=key, status=ToolCallStatus.FAILED, answered_at=now,
            response_summary=f"not run: {message}"[:SUMMARY_MAX_CHARS],
        )
        return Claim("in_doubt", key, message=message)


def _claim_new_key(*, key: str, record: dict[str, Any], lease: uuid.UUID | None) -> bool:
    """PostgreSQL: the common claim, a key never seen, as one statement and one commit.

    The run's row lock (`leases.hold`'s FOR NO KEY UPDATE), the record and the journal's
    effect key ride in one autocommitted statement: a round trip where the transaction below
    takes seven, on the one ORM thread every run of the process shares. True when this call's
    record was written; False when the key had one (the caller reads it); refused when the
    lease no longer holds the run.
    """
    sql, params = _new_key_claim(key=key, record=record, lease=lease)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        held_rows, claimed_rows = cursor.fetchone()
    return _new_key_claimed(record=record, held_rows=held_rows, claimed_rows=claimed_rows)


async def claim_new_key_on(store: Any, *, key: str, record: dict[str, Any], lease: uuid.UUID | None) -> bool:
    """`_claim_new_key` on the agent loop's own connection to the same database (the session
    store's, `on_own_connection`): no hop to the ORM thread, and a statement psycopg prepares
    instead of one Django sends as text to be parsed anew each time. Committed when it returns.
    """
    sql, params = _new_key_claim(key=key, record=record, lease=lease)

    def claim(conn) -> tuple[int, int]:
        return tuple(conn.exec_driver_sql(sql, tuple(params)).one())

    held_rows, claimed_rows = await store.on_own_connection(claim, autocommit=True)
    return _new_key_claimed(record=record, held_rows=held_rows, claimed_rows=claimed_rows)


def _new_key_claimed(*, record: dict[str, Any], held_rows: int, claimed_rows: int) -> bool:
    if not held_rows:
        raise leases.refuse(run_id=record["first_run_id"], what="an effect record")
    return claimed_rows == 1


# Stand-ins the statement is compiled with once; each claim puts its own values in their places.
_RUN_STAND_IN = uuid.UUID(int=1)
_LEASE_STAND_IN = uuid.UUID(int=2)
_CLAIM_FIELDS = ("key", "status", "error", "intent_id", "tool_name", "business_key", "stable_fields",
                 "first_run_id", "first_call_id", "started_at")
_compiled_claims: dict[tuple[str, bool], tuple[str, tuple]] = {}


def _compiled_claim(*, fenced: bool) -> tuple[str, tuple]:
    """The claim's SQL and the fence's parameters with stand-ins, compiled by Django once per process."""
    cache_key = (connection.alias, fenced)
    built = _compiled_claims.get(cache_key)
    if built is not None:
        return built
    effect = ToolEffect._meta
    columns = [effect.get_field(name).column for name in _CLAIM_FIELDS]
    if not fenced:
        held, held_params = "SELECT 1", ()  # a run executed outside the ledger's claim: nothing to fence
    else:
        # The fence's one definition (`leases.held`), with `leases.hold`'s lock; Django refuses to
        # compile select_for_update() outside a transaction, and this statement is its own.
        query = leases.held(run_id=_RUN_STAND_IN, lease=_LEASE_STAND_IN).order_by().values("pk").query
        held, held_params = query.sql_with_params()
        held += " FOR NO KEY UPDATE"
    sql = (
        f"WITH held AS ({held}), "
        f"claimed AS (INSERT INTO {effect.db_table} ({', '.join(columns)}) "
        f"SELECT {', '.join(['%s'] * len(columns))} FROM held ON CONFLICT (key) DO NOTHING RETURNING 1), "
        f"journaled AS (UPDATE {ToolCall._meta.db_table} SET effect_key = %s "
        "WHERE run_id = %s AND call_id = %s AND EXISTS (SELECT 1 FROM claimed) RETURNING 1) "
        "SELECT (SELECT count(*) FROM held), (SELECT count(*) FROM claimed)"
    )
    built = _compiled_claims[cache_key] = (sql, tuple(held_params))
    return built


def _new_key_claim(*, key: str, record: dict[str, Any], lease: uuid.UUID | None) -> tuple[str, list]:
    """The one statement of `_claim_new_key` and its parameters (compiled by Django, sent by either)."""
    effect = ToolEffect._meta
    run_id, call_id = record["first_run_id"], record["first_call_id"]
    values = {"key": key, "status": EffectStatus.STARTED, "error": "", **record}
    params = [effect.get_field(name).get_db_prep_save(values[name], connection) for name in _CLAIM_FIELDS]
    run_pk = AgentRun._meta.pk.get_db_prep_save(run_id, connection)
    sql, held_params = _compiled_claim(fenced=lease is not None)
    stand_ins = {
        _RUN_STAND_IN: run_pk,
        _LEASE_STAND_IN: AgentRun._meta.get_field("lease").get_db_prep_save(lease, connection),
    }
    held_values = [stand_ins.get(value, value) for value in held_params]
    return sql, [*held_values, *params, key, run_pk, call_id]


def _owned_started(*, key: str, run_id: uuid.UUID, call_id: str, lease: uuid.UUID | None):
    records = ToolEffect.objects.filter(key=key, status=EffectStatus.STARTED, first_run_id=run_id, first_call_id=call_id)
    # The lease check rides in the write's own statement; a run no longer held leaves its record
    # `started`: in doubt, as for a worker that died while its tool ran.
    return records.filter(leases.held_q(run_id=run_id, lease=lease)) if lease is not None else records


def _refuse_if_lost(*, run_id: uuid.UUID, lease: uuid.UUID | None, what: str) -> None:
    # Only a write that matched nothing pays for this read.
    if lease is not None and not leases.held(run_id=run_id, lease=lease).exists():
        raise leases.refuse(run_id=run_id, what=what)


def finish_effect(*, key: str, run_id: uuid.UUID, call_id: str, result: Any, lease: uuid.UUID | None = None) -> bool:
    """The tool answered: its record is done, with what it said (served to every repeat)."""
    done = _owned_started(key=key, run_id=run_id, call_id=call_id, lease=lease).update(
        status=EffectStatus.DONE, result=json_safe(result), finished_at=timezone.now()
    ) == 1
    if not done:
        _refuse_if_lost(run_id=run_id, lease=lease, what="an effect's result")
    return done


def note_effect_error(*, key: str, run_id: uuid.UUID, call_id: str, error: str, lease: uuid.UUID | None = None) -> None:
    """The tool raised: it may have acted first, so the record stays `started` (in doubt), with the error."""
    if not _owned_started(key=key, run_id=run_id, call_id=call_id, lease=lease).update(error=error[:SUMMARY_MAX_CHARS]):
        _refuse_if_lost(run_id=run_id, lease=lease, what="an effect's error")


def release_effect(*, key: str, run_id: uuid.UUID, call_id: str, lease: uuid.UUID | None = None) -> None:
    """The tool did not run after all (it waits for a person's confirmation): nothing to record."""
    if not _owned_started(key=key, run_id=run_id, call_id=call_id, lease=lease).delete()[0]:
        _refuse_if_lost(run_id=run_id, lease=lease, what="an effect's release")


def record_effect_class(*, run_id: uuid.UUID, call_id: str, effect: str, lease: uuid.UUID | None = None) -> None:
    calls = ToolCall.objects.filter(run_id=run_id, call_id=call_id, effect="")
    if lease is not None:
        calls = calls.filter(leases.held_q(run_id=run_id, lease=lease))
    if not calls.update(effect=effect):
        _refuse_if_lost(run_id=run_id, lease=lease, what="a call's effect class")


# --- The plugin ----------------------------------------------------------------------------------


def _tools_of_author(invocation_context: Any, author: str) -> dict[str, Any]:
    """The tools the agent that authored an event holds, by the name the model calls them."""
    agent = getattr(invocation_context, "agent", None)
    root = getattr(agent, "root_agent", None) or agent
    found = None
    finder = getattr(root, "find_agent", None)
    if callable(finder):
        try:
            found = finder(author)
        except Exception:  # noqa: BLE001 - a tree we cannot search only costs the early stamp
            found = None
    holder = found or agent
    tools: dict[str, Any] = {}
    for tool in getattr(holder, "tools", None) or []:
        name = tool_name(tool)
        if name:
            tools[name] = tool
    return tools


class EffectsPlugin(BasePlugin):
    """Effect classes into the journal; idempotency keys and effect records around each tool."""

    def __init__(self, run: AgentRun):
        super().__init__(name="agent_ledger_effects")
        self.run = run
        self.trusted_servers = tuple(settings.MCP_TRUSTED_SERVERS)
        self._intent: str | None = None
        self._stamped: set[str] = set()
        self._owned: dict[str, str] = {}  # call id -> key of the record this run started

    def effect_of(self, tool: Any):
        return effect_of_tool(tool, trusted_servers=self.trusted_servers)

    async def on_event_callback(self, *, invocation_context, event):
        calls = [] if event.partial else event.get_function_calls()
        if not calls:
            return None
        tools = _tools_of_author(invocation_context, event.author)
        stamped = {call.id: self.effect_of(tools[call.name]).kind for call in calls if call.id and call.name in tools}
        # ADK's own calls (a transfer, a confirmation request) have no tool on the agent to read.
        stamped.update({
            call.id: control.kind
            for call in calls
            if call.id and call.id not in stamped and (control := effect_of_call_name(call.name or ""))
        })
        if stamped:
            # Stored with the event, in the same transaction as its journal rows.
            event.custom_metadata = {**(event.custom_metadata or {}), EFFECTS_METADATA_KEY: stamped}
            self._stamped.update(stamped)
        return None

    def _intent_id(self) -> str:
        """On the ORM thread, inside the first claim's hop (it may read the run's chain)."""
        if self._intent is None:
            self._intent = intent_id(self.run)
        return self._intent

    async def before_tool_callback(self, *, tool, tool_args, tool_context):
        call_id = tool_context.function_call_id or ""
        effect = self.effect_of(tool)
        if call_id not in self._stamped:
            # A toolset's tool (e.g. MCP) is only known now: record its class before it runs.
            await sync_to_async(record_effect_class)(
                run_id=self.run.run_id, call_id=call_id, effect=effect.kind, lease=self.run.lease
            )
        if effect.kind != IDEMPOTENT or not effect.keyed:
            return None
        try:
            business_key = effect.business_key(tool_args or {})
        except KeyArgumentMissing:
            return None  # the tool itself refuses a call without its arguments
        stable_fields = json_safe(effect.stable_fields(tool_args or {}))

        own_claim_may_exist = False
        intent = self._intent or root_intent_id(self.run)
        store = session_service() if intent is not None and connection.vendor == "postgresql" else None
        if store is not None and store.dialect == "postgresql":
            # The common claim (a key never seen) on the loop's own connection; a key with a
            # record already (a repeat, a replay) is read and decided on the ORM thread, below.
            key = effect_key(intent=intent, tool=tool.name, business_key=business_key)
            record = new_record(
                run_id=self.run.run_id, call_id=call_id, intent=intent, tool=tool.name,
                business_key=business_key, stable_fields=stable_fields,
            )
            try:
                if await claim_new_key_on(store, key=key, record=record, lease=self.run.lease):
                    self._owned[call_id] = key
                    return None
            except DBAPIError as exc:
                if not exc.connection_invalidated:
                    raise
                # The connection broke (idle in the pool, or mid-statement): whether the claim
                # committed is read below, where this call's own record counts as its claim.
                logger.warning("Run %s: the effect claim's connection broke (%s); deciding on the ORM thread",
                               self.run.run_id, exc.orig)
                own_claim_may_exist = True

        def claim_it():
            # The run's intent is worked out in the same hop to the ORM thread as the claim.
            return claim_effect(
                run_id=self.run.run_id,
                call_id=call_id,
                intent=self._intent_id(),
                tool=tool.name,
                business_key=business_key,
                stable_fields=stable_fields,
                lease=self.run.lease,
                own_claim_may_exist=own_claim_may_exist,
            )

        claim = await sync_to_async(claim_it)()
        if claim.kind == "run":
            self._owned[call_id] = claim.key
            return None
        if claim.kind == "served":
            return claim.result
        if claim.kind == "refused":
            return {"error": claim.message}
        raise EffectInDoubt(f"Call {call_id} to {tool.name} was not run: {claim.message}", call_id=call_id,
                            tool_name=tool.name)

    async def after_tool_callback(self, *, tool, tool_args, tool_context, result):
        call_id = tool_context.function_call_id or ""
        key = self._owned.pop(call_id, None)
        if key is None:
            return None
        confirmation = tool_context.tool_confirmation
        rejected = confirmation is not None and not confirmation.confirmed
        # Asked for a confirmation, or rejected by a person: the tool did not run, there is nothing to record.
        if rejected or call_id in (tool_context.actions.requested_tool_confirmations or {}):
            await sync_to_async(release_effect)(key=key, run_id=self.run.run_id, call_id=call_id, lease=self.run.lease)
            return None
        if self._stored_here(tool_context):
            # Marked done by the journal with the response event that carries this result, in
            # its transaction (`runs.ledger.journal`): no write of its own, and never done without it.
            return None
        await sync_to_async(finish_effect)(
            key=key, run_id=self.run.run_id, call_id=call_id, result=result, lease=self.run.lease
        )
        return None

    def _stored_here(self, tool_context) -> bool:
        """Whether the call's response event goes to the run's own session, which the executor
        keeps in the ledger's store (not, say, to the in-memory session of an agent wrapped by an
        `AgentTool`: the journal never sees that one)."""
        return tool_context.invocation_id == self.run.invocation_id and tool_context.session.id == self.run.session_id

    async def on_tool_error_callback(self, *, tool, tool_args, tool_context, error):
        call_id = tool_context.function_call_id or ""
        key = self._owned.pop(call_id, None)
        if key is not None:
            await sync_to_async(note_effect_error)(
                key=key, run_id=self.run.run_id, call_id=call_id, error=f"{type(error).__name__}: {error}",
                lease=self.run.lease,
            )
        return None


# --- Calls in doubt ------------------------------------------------------------------------------------


def owned_record(call: ToolCall) -> ToolEffect | None:
    """The effect record this call started (not one it was served from or refused by)."""
    if not call.effect_key:
        return None
    return ToolEffect.objects.filter(key=call.effect_key, first_run_id=call.run_id, first_call_id=call.call_id).first()


def doubt_of(run: AgentRun, call: ToolCall, record: ToolEffect | None) -> str:
    """Why the call is in doubt ("" when it is not): it never answered, or its effect never finished."""
    if run.is_in_flight or call.settled_outcome:
        return ""
    if call.status == ToolCallStatus.CALLED:
        return "it was called and never answered"
    if record is not None and record.status == EffectStatus.STARTED:
        return "its effect was started and never recorded as finished"
    return ""
