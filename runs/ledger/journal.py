"""The tool journal: every function call is written down before its tool can start.

ADK persists a function-call event (`DatabaseSessionService.append_event`, one transaction) and
only then lets the tool run. The journal rides in that same transaction: an SQLAlchemy
`after_insert` hook on ADK's event row writes one `tool_calls` row per function call, and marks
the calls a function-response event answers. So a call is journaled exactly when its event is
stored — never one without the other — and both are committed before the tool starts, at no
extra commit per call.

Each row names the agent of the tree that made the call (the event's author). Calls made by an
agent wrapped in an `AgentTool` run in ADK's in-memory session, not ours: the plugin journals
them through Django as their events pass, still before their tools start. Failures the session
never records (a tool that raised has no response event) are written by
`JournalPlugin.on_tool_error_callback` through Django.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from asgiref.sync import sync_to_async
from django.db import DatabaseError, IntegrityError, connections, transaction
from django.db.models import Exists, JSONField, Max
from django.db.models.expressions import RawSQL
from django.utils import timezone
from google.adk.plugins.base_plugin import BasePlugin
from google.adk.sessions.database_session_service import DatabaseSessionService
from google.adk.sessions.schemas.v1 import StorageEvent
from google.adk.utils._function_call_names import REQUEST_CONFIRMATION_FUNCTION_CALL_NAME
from sqlalchemy import event as sqlalchemy_event
from sqlalchemy import text
from sqlalchemy.sql.elements import TextClause

from agents.mcp_answers import readable_answer
from agents.models import AdkEvent
from runs.ledger import leases
from runs.models.effects import ToolEffect
from runs.models.ledger import KEPT_ON_ANSWER, NEVER_RAN, AgentRun, ToolCall, ToolCallStatus

logger = logging.getLogger(__name__)

# The key runs.ledger.effects stamps into a function-call event's custom_metadata (kept here so the
# journal, written with the event, does not import the plugin).
EFFECTS_METADATA_KEY = "agent_ledger_effects"

SUMMARY_MAX_CHARS = 500
# ADK's request for a person's confirmation is not a tool: it acts on nothing, and what it asks is
# recorded as the run's PendingCall (runs.ledger.approvals). The call it asks about is journaled as usual.
NOT_TOOLS = frozenset({REQUEST_CONFIRMATION_FUNCTION_CALL_NAME})
ABORTED_RESPONSE = "Invocation was aborted by client."

_INSERT_CALL = text(
    # seq continues the run's journal. A conflict inserts nothing and is told apart below (a seq
    # taken by a concurrent branch, or a call id the run already used); it is never let pass
    # silently. The WHERE clause also keeps SQLite's parser from reading ON CONFLICT as a join.
    "INSERT INTO tool_calls (run_id, seq, call_id, tool_name, agent_name, args, status, called_at, response_summary, "
    "effect, effect_key, settled_outcome, settle_note) "
    "SELECT :run_id, COALESCE(MAX(seq), 0) + 1, :call_id, :tool_name, :agent_name, :args, :status, :called_at, '', "
    ":effect, '', '', '' "
    "FROM tool_calls WHERE run_id = :run_id "
    "ON CONFLICT DO NOTHING"
)
_CALL_ID_TAKEN = text("SELECT tool_name FROM tool_calls WHERE run_id = :run_id AND call_id = :call_id")
# Attempts at a free seq when concurrent branches of one run journal at the same moment.
SEQ_ATTEMPTS = 5


class DuplicateCallId(RuntimeError):
    """A function call reuses a call id its run already journaled.

    The journal keeps one row per (run, call id); dropping the second call would hide a tool that
    ran, so its event is refused instead (its transaction rolls back and the tool never starts).
    """

    def __init__(self, call_id: str, tool_name: str, taken_by: str):
        self.call_id = call_id
        super().__init__(
            f"The call {call_id!r} to {tool_name} reuses the id of an earlier call to {taken_by} in this run; "
            "it was refused before its tool started (call ids must be unique in a run)."
        )


def duplicate_call_of(exc: BaseException | None) -> DuplicateCallId | None:
    """The DuplicateCallId behind an error (ADK and SQLAlchemy may wrap it), if there is one."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DuplicateCallId):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


_ANSWER_CALL = text(
    # A call answered from its effect record (or refused by it) keeps saying so.
    # A call that never ran (waiting, rejected) keeps its words too: ADK's answer to it is plumbing.
    "UPDATE tool_calls SET status = CASE WHEN status IN ('deduplicated', 'refused', 'waiting', 'not_run') "
    "THEN status ELSE :status END, "
    "response_summary = CASE WHEN status IN ('waiting', 'not_run') THEN response_summary ELSE :summary END, "
    "answered_at = :answered_at "
    "WHERE run_id = :run_id AND call_id = :call_id "
    "RETURNING effect_key"
)


def summarize(value: Any) -> str:
    try:
        encoded = json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError):
        encoded = repr(value)
    if len(encoded) > SUMMARY_MAX_CHARS:
        encoded = f"{encoded[:SUMMARY_MAX_CHARS]}… ({len(encoded)} chars)"
    return encoded


def run_id_of(event_data: dict) -> uuid.UUID | None:
    """The run an ADK event belongs to: stamped by RunConfig.custom_metadata on every event."""
    run_id = (event_data.get("custom_metadata") or {}).get("run_id")
    if not run_id:
        return None
    try:
        return uuid.UUID(str(run_id))
    except ValueError:
        return None


def _db_value(field_name: str, value: Any) -> Any:
    """A value as Django would send it to the database (uuid, JSON and datetimes differ by vendor)."""
    field = ToolCall._meta.get_field(field_name)
    if field_name == "run":
        field = field.target_field
    return field.get_db_prep_value(value, connections["default"], prepared=False)


def journal_rows(event_data: dict) -> tuple[uuid.UUID | None, list[dict], list[dict]]:
    """The journal writes one stored ADK event implies: (run_id, calls, answers)."""
    run_id = run_id_of(event_data)
    if run_id is None or event_data.get("partial"):
        return run_id, [], []
    parts = (event_data.get("content") or {}).get("parts") or []
    # The effect class of each call at call time, stamped by runs.ledger.effects.EffectsPlugin.
    effects = (event_data.get("custom_metadata") or {}).get(EFFECTS_METADATA_KEY) or {}
    now = timezone.now()
    author = event_data.get("author") or ""
    calls = [
        {
            "call_id": part["function_call"].get("id") or "",
            "tool_name": part["function_call"].get("name") or "",
            "agent_name": "" if author == "user" else author,
            "args": part["function_call"].get("args") or {},
            "effect": str(effects.get(part["function_call"].get("id") or "", ""))[:16],
            "called_at": now,
        }
        for part in parts
        if part.get("function_call") and part["function_call"].get("name") not in NOT_TOOLS
    ]
    answers = []
    for part in parts:
        response = part.get("function_response")
        if not response:
            continue
        payload = response.get("response") or {}
        aborted = isinstance(payload, dict) and payload.get("error") == ABORTED_RESPONSE
        answers.append(
            {
                "call_id": response.get("id") or "",
                # What an effect record this answer finishes serves to every repeat.
                "result": payload,
                "status": ToolCallStatus.FAILED if aborted else ToolCallStatus.ANSWERED,
                # An MCP answer is shown as the value it carries, not as JSON inside a string.
                "summary": "aborted before it answered" if aborted else summarize(readable_answer(payload)),
                "answered_at": now,
            }
        )
    return run_id, calls, answers


@sqlalchemy_event.listens_for(StorageEvent, "after_insert")
def _journal_with_the_event(mapper, connection, target: StorageEvent) -> None:
    run_id, calls, answers = journal_rows(target.event_data or {})
    if run_id is None:
        return
    run_value = _db_value("run", run_id)
    for call in calls:
        row = {
            "run_id": run_value,
            "call_id": call["call_id"],
            "tool_name": call["tool_name"],
            "agent_name": call["agent_name"],
            "args": _db_value("args", call["args"]),
            "status": ToolCallStatus.CALLED.value,
            "called_at": _db_value("called_at", call["called_at"]),
            "effect": call["effect"],
        }
        for _attempt in range(SEQ_ATTEMPTS):
            if connection.execute(_INSERT_CALL, row).rowcount:
                break
            taken = connection.execute(_CALL_ID_TAKEN, {"run_id": run_value, "call_id": call["call_id"]}).first()
            if taken is not None:
                raise DuplicateCallId(call["call_id"], call["tool_name"], taken[0])
        else:
            raise DatabaseError(f"The call {call['call_id']!r} could not be journaled: no free seq after "
                                f"{SEQ_ATTEMPTS} attempts.")
    if getattr(target, _ANSWERS_RODE, False):
        return  # written by the event's own statement (AnswersRider)
    for answer in answers:
        answered_at = _db_value("answered_at", answer["answered_at"])
        effect_key = connection.execute(
            _ANSWER_CALL,
            {
                "run_id": run_value,
                "call_id": answer["call_id"],
                "status": answer["status"].value,
                "answered_at": answered_at,
                "summary": answer["summary"],
            },
        ).scalar()
        # Only a call that claimed an effect record pays for finishing one.
        if effect_key and answer["status"] == ToolCallStatus.ANSWERED:
            connection.execute(
                _FINISH_EFFECT,
                {
                    "run_id": run_value,
                    "call_id": answer["call_id"],
                    "result": _effect_result(answer["result"]),
                    "finished_at": answered_at,
                },
            )


# The effect record this call started (`runs.ledger.effects.claim_effect`) is done with the answer, in the
# answer's own transaction: a record is `done` exactly when the response the model reads from
# is stored. A record with an error noted (the tool raised) stays `started`: in doubt.
_FINISH_EFFECT = text(
    "UPDATE tool_effects SET status = 'done', result = :result, finished_at = :finished_at "
    "WHERE status = 'started' AND error = '' AND first_run_id = :run_id AND first_call_id = :call_id "
    "AND key = (SELECT effect_key FROM tool_calls WHERE run_id = :run_id AND call_id = :call_id)"
)


def _effect_result(result: Any) -> Any:
    field = ToolEffect._meta.get_field("result")
    return field.get_db_prep_value(json_safe(result), connections["default"], prepared=False)


def json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# Set on an event row whose answers AnswersRider wrote in the append statement itself.
_ANSWERS_RODE = "_agent_ledger_answers_rode"

_ANSWER_CALLS_IN_THE_APPEND = text(
    # _ANSWER_CALL for every answer of the event at once, as a CTE of its append (PostgreSQL):
    # it reads `stored`, so it writes only if the event row went in, under the same fence.
    "UPDATE tool_calls SET status = CASE WHEN tool_calls.status IN ('deduplicated', 'refused', 'waiting', 'not_run') "
    "THEN tool_calls.status ELSE a.status END, answered_at = a.answered_at, "
    "response_summary = CASE WHEN tool_calls.status IN ('waiting', 'not_run') THEN tool_calls.response_summary "
    "ELSE a.summary END "
    "FROM jsonb_to_recordset(CAST(:k_ride_answers AS jsonb)) "
    "AS a(call_id text, status text, answered_at timestamptz, summary text) "
    "WHERE tool_calls.run_id = :k_ride_run AND tool_calls.call_id = a.call_id AND EXISTS (SELECT 1 FROM stored) "
    "RETURNING 1 AS n"
)


_FINISH_EFFECTS_IN_THE_APPEND = text(
    # _FINISH_EFFECT for every answer of the event at once, in its append (PostgreSQL).
    "UPDATE tool_effects SET status = 'done', result = a.result, finished_at = a.answered_at "
    "FROM jsonb_to_recordset(CAST(:k_ride_answers AS jsonb)) "
    "AS a(call_id text, status text, answered_at timestamptz, summary text, result jsonb), tool_calls c "
    "WHERE a.status = 'answered' AND c.run_id = :k_ride_run AND c.call_id = a.call_id "
    "AND tool_effects.key = c.effect_key AND tool_effects.status = 'started' AND tool_effects.error = '' "
    "AND tool_effects.first_run_id = :k_ride_run AND tool_effects.first_call_id = a.call_id "
    "AND EXISTS (SELECT 1 FROM stored) "
    "RETURNING 1 AS n"
)


class AnswersRider:
    """`agents.session_sql`'s append rider: a function response marks the calls it answers, and
    finishes the effect records they started, in its own event's statement (no statement or
    round trip of their own).

    Installed by `runs.apps`; PostgreSQL only (SQLite has no data-modifying CTE, and the
    after_insert hook above writes the answers there, as it does for any event this does not take).
    """

    def sql(self) -> list[TextClause]:
        return [_ANSWER_CALLS_IN_THE_APPEND, _FINISH_EFFECTS_IN_THE_APPEND]

    def params(self, row: StorageEvent) -> dict[str, Any] | None:
        run_id, _calls, answers = journal_rows(row.event_data or {})
        if run_id is None or not answers:
            return None
        setattr(row, _ANSWERS_RODE, True)
        return {
            "k_ride_run": _db_value("run", run_id),
            "k_ride_answers": json.dumps(
                [
                    {
                        "call_id": answer["call_id"],
                        "status": answer["status"].value,
                        "answered_at": answer["answered_at"].isoformat(),
                        "summary": answer["summary"],
                        "result": answer["result"],
                    }
                    for answer in answers
                ],
                default=str,
            ),
        }


def journal_outside_the_session(event_data: dict, *, lease: uuid.UUID | None = None) -> None:
    """Journal an event that no Agent Ledger session stores, through Django, before it goes on.

    An agent wrapped by an `AgentTool` runs in a session of ADK's own, in memory: its events never
    reach the event table, so the hook above never sees them. The plugin writes them here; the
    write commits before ADK runs the call's tool, as it does for stored events, and only while
    `lease` still holds the run (`runs.ledger.leases`).
    """
    run_id, calls, answers = journal_rows(event_data)
    if run_id is None:
        return
    for call in calls:
        for _attempt in range(5):
            try:
                with transaction.atomic():
                    leases.hold(run_id=run_id, lease=lease, what="a function call's journal row")
                    taken = ToolCall.objects.filter(run_id=run_id, call_id=call["call_id"]).first()
                    if taken is not None:
                        raise DuplicateCallId(call["call_id"], call["tool_name"], taken.tool_name)
                    last = ToolCall.objects.filter(run_id=run_id).aggregate(last=Max("seq"))["last"] or 0
                    ToolCall.objects.create(run_id=run_id, seq=last + 1, status=ToolCallStatus.CALLED, **call)
                break
            except IntegrityError:
                continue  # a concurrent branch took that seq: count again
    for answer in answers:
        with transaction.atomic():
            leases.hold(run_id=run_id, lease=lease, what="a function response's journal row")
            calls = ToolCall.objects.filter(run_id=run_id, call_id=answer["call_id"])
            calls.filter(status__in=KEPT_ON_ANSWER).update(answered_at=answer["answered_at"])
            calls.exclude(status__in=KEPT_ON_ANSWER).update(
                status=answer["status"], answered_at=answer["answered_at"], response_summary=answer["summary"]
            )


def record_outcome(
    run_id: uuid.UUID, call_id: str, *, status: str, summary: str, lease: uuid.UUID | None = None
) -> None:
    calls = ToolCall.objects.filter(run_id=run_id, call_id=call_id)
    if lease is not None:
        calls = calls.filter(leases.held_q(run_id=run_id, lease=lease))
    if not calls.update(status=status, answered_at=timezone.now(), response_summary=summary) and lease is not None:
        if not leases.held(run_id=run_id, lease=lease).exists():
            raise leases.refuse(run_id=run_id, what="a tool's failure")


def journal_tools(run_id: uuid.UUID) -> list[str]:
    """The tools the run called, in order; a call that waited and never ran is not one of them."""
    calls = ToolCall.objects.filter(run_id=run_id).exclude(status__in=NEVER_RAN)
    return list(calls.order_by("seq").values_list("tool_name", flat=True))


def has_journal(run_id: uuid.UUID) -> Exists:
    return Exists(ToolCall.objects.filter(run_id=run_id))


class _JournalTools(RawSQL):
    """`journal_tools` of the row being updated, as a JSON list in the UPDATE (same order: seq)."""

    def __init__(self) -> None:
        super().__init__("", [], output_field=JSONField())

    def as_sql(self, compiler, connection):
        runs, calls = connection.ops.quote_name(AgentRun._meta.db_table), connection.ops.quote_name(ToolCall._meta.db_table)
        never_ran = "(" + ", ".join(f"'{status}'" for status in NEVER_RAN) + ")"
        if connection.vendor == "postgresql":
            return (
                f"COALESCE((SELECT jsonb_agg(c.tool_name ORDER BY c.seq) FROM {calls} c WHERE c.run_id = {runs}.run_id "
                f"AND c.status NOT IN {never_ran}), '[]'::jsonb)", []
            )
        # SQLite before 3.44 has no ORDER BY inside an aggregate; it aggregates in the subquery's order.
        return (
            f"(SELECT json_group_array(c.tool_name) FROM (SELECT tool_name FROM {calls} "
            f"WHERE run_id = {runs}.run_id AND status NOT IN {never_ran} ORDER BY seq) c)",
            [],
        )


def journal_tools_sql() -> RawSQL:
    """An UPDATE of agent_runs may set `tools_executed` to this: the journal's tools, read in place."""
    return _JournalTools()


class JournalPlugin(BasePlugin):
    """Records what the session cannot: a tool that raised (it never answers)."""

    def __init__(self, run_id: uuid.UUID, *, lease: uuid.UUID | None = None):
        super().__init__(name="agent_ledger_journal")
        self.run_id = run_id
        self.lease = lease
        self.tool_errors: dict[str, BaseException] = {}

    async def on_event_callback(self, *, invocation_context, event):
        if event.partial or isinstance(invocation_context.session_service, DatabaseSessionService):
            return None  # stored events are journaled in their own transaction
        if event.get_function_calls() or event.get_function_responses():
            await sync_to_async(journal_outside_the_session)(
                event.model_dump(mode="json", exclude_none=True), lease=self.lease
            )
        return None

    async def on_tool_error_callback(self, *, tool, tool_args, tool_context, error):
        call_id = tool_context.function_call_id or ""
        self.tool_errors[call_id] = error
        await sync_to_async(record_outcome)(
            self.run_id,
            call_id,
            status=ToolCallStatus.FAILED,
            summary=f"{type(error).__name__}: {error}"[:SUMMARY_MAX_CHARS],
            lease=self.lease,
        )
        return None


# --- Evidence: what a run called, for settling and reconciling -------------------------------------


def session_tools(run: AgentRun) -> list[str]:
    """Tools called according to ADK's stored events, from the run's user message on."""
    events = AdkEvent.objects.of_invocation(
        app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id, invocation_id=run.invocation_id
    )
    names: list[str] = []
    seen_user_message = False
    for event in events:
        if not seen_user_message:
            seen_user_message = event.author == "user"
            if seen_user_message:
                continue
        names.extend(call.get("name", "") for call in event.function_calls if call.get("name") not in NOT_TOOLS)
    return names


def derive_tools_executed(run: AgentRun) -> list[str] | None:
    """The three states of `tools_executed`: the journal, else the session, else unknown (None).

    A journal row is written before its tool can start, so a readable journal is the truth. An
    empty journal is still cross-checked against the session: unknown is not none.
    """
    from_journal: list[str] | None
    try:
        from_journal = journal_tools(run.run_id)
        # Rows that all never ran (asked of a person, rejected) are a journal: none called.
        if not from_journal and ToolCall.objects.filter(run_id=run.run_id, status__in=NEVER_RAN).exists():
            return []
    except DatabaseError:
        logger.exception("Run %s: the tool journal could not be read", run.run_id)
        from_journal = None
    if from_journal:
        return from_journal
    return _tools_from_session(run, from_journal)


def tools_without_journal(run: AgentRun) -> list[str]:
    """`derive_tools_executed` for a run whose journal was just read empty (by the settle's UPDATE)."""
    return _tools_from_session(run, []) or []


def _tools_from_session(run: AgentRun, from_journal: list[str] | None) -> list[str] | None:
    try:
        from_session = session_tools(run)
    except (DatabaseError, ValueError, TypeError):
        logger.exception("Run %s: the ADK session could not be read", run.run_id)
        from_session = None
    if from_session:
        return from_session
    if from_journal is not None:
        return from_journal
    return from_session
