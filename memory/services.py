"""Long-term memory's rules. The ADK memory service, the API, the admin, the command and the
daily task are doors onto these functions.

What is remembered: the text a user wrote and the text the agent answered, per (agent, owner).
Tool arguments and results, inline files and anything that looks like base64 are left out:
they are evidence for the ledger, not something to replay into a prompt.
"""

from __future__ import annotations

import hashlib
import logging
import re
import unicodedata
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connections, transaction
from django.utils import timezone
from google.adk.events.event import Event

from agents.models import AdkEvent
from agents.registry import UnknownAgentError, get_agent_spec
from memory import search
from memory.models import MemoryEntry, ScopeRequired
from memory.refusals import InvalidLimit, InvalidQuery, MissingScope, UnknownAgent
from memory.search import search_terms

logger = logging.getLogger(__name__)

MAX_TEXT_CHARS = 4000
MAX_SCOPE_CHARS = 128
MAX_QUERY_CHARS = 2000
MAX_RESULTS = 100
OMITTED = "[data omitted]"

_DATA_URL = re.compile(r"data:[\w.+-]+/[\w.+-]+;base64,[A-Za-z0-9+/=]+")
_LONG_BASE64 = re.compile(r"[A-Za-z0-9+/]{200,}={0,2}")


# --- What gets remembered ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Remembered:
    event_id: str
    author: str
    text: str
    timestamp: datetime
    session_id: str = ""
    run_id: uuid.UUID | None = None


def scrub(text: str) -> str:
    """Drop embedded payloads (data URLs, long base64 runs) and cap the length."""
    text = _DATA_URL.sub(OMITTED, text)
    text = _LONG_BASE64.sub(OMITTED, text)
    text = text.replace("\x00", "").strip()
    if len(text) > MAX_TEXT_CHARS:
        text = text[:MAX_TEXT_CHARS].rstrip() + "…"
    return text


def remembered_text(event: Event) -> str:
    """The text of a user message or a model answer; "" for anything else.

    Function calls, function responses (authored by the agent with role "user"), inline data,
    thoughts and streamed fragments are not memories.
    """
    if event.partial or not event.content or not event.content.parts:
        return ""
    role = event.content.role
    if event.author == "user":
        if role not in (None, "user"):
            return ""
    elif role != "model":
        return ""
    texts = [part.text for part in event.content.parts if part.text and not part.thought]
    return scrub("\n".join(texts))


def as_uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value)) if value else None
    except ValueError:
        return None


def _event_time(event: Event) -> datetime:
    if event.timestamp:
        return datetime.fromtimestamp(event.timestamp, tz=UTC)
    return timezone.now()


def memories_from_events(
    events: Iterable[Event], *, session_id: str = "", run_id: uuid.UUID | None = None
) -> list[Remembered]:
    items = []
    for event in events:
        text = remembered_text(event)
        if not text:
            continue
        event_run = run_id or as_uuid((event.custom_metadata or {}).get("run_id"))
        event_id = event.id or content_hash(event.author or "", text, str(event.timestamp or ""))
        items.append(
            Remembered(
                event_id=event_id,
                author=(event.author or "")[:MAX_SCOPE_CHARS],
                text=text,
                timestamp=_event_time(event),
                session_id=session_id,
                run_id=event_run,
            )
        )
    return items


def content_hash(author: str, text: str, when: str = "") -> str:
    """A stable id for a memory that has no event id, so writing it twice stores it once."""
    digest = hashlib.sha256(f"{author}\x1f{when}\x1f{text}".encode()).hexdigest()
    return f"m-{digest[:40]}"


# --- Scope ------------------------------------------------------------------------------------------------


def _check_scope_value(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise MissingScope(f"{name} is required: memories are kept per agent and per owner.")
    value = value.strip()
    if len(value) > MAX_SCOPE_CHARS:
        raise MissingScope(f"{name} is longer than {MAX_SCOPE_CHARS} characters.")
    if any(unicodedata.category(ch).startswith("C") for ch in value):
        raise MissingScope(f"{name} contains control characters.")
    return value


def clean_scope(*, agent: Any, owner_id: Any) -> tuple[str, str]:
    """Check a scope given by a caller: both parts present, and the agent registered."""
    missing = [name for name, value in (("agent", agent), ("owner_id", owner_id)) if not (isinstance(value, str) and value.strip())]
    if missing:
        raise MissingScope(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required: "
            "memories are kept per agent and per owner."
        )
    agent = _check_scope_value("agent", agent)
    owner_id = _check_scope_value("owner_id", owner_id)
    try:
        get_agent_spec(agent)
    except UnknownAgentError as exc:
        raise UnknownAgent(str(exc)) from None
    return agent, owner_id


def clean_query(query: Any) -> str:
    if not isinstance(query, str) or not query.strip():
        raise InvalidQuery("q is required: the words to search the memories for.")
    if len(query) > MAX_QUERY_CHARS:
        raise InvalidQuery(f"q is {len(query)} characters long; the limit is {MAX_QUERY_CHARS}.")
    # As the schema's `search-words` format says: words, never control or invisible characters.
    if any(unicodedata.category(ch).startswith("C") for ch in query):
        raise InvalidQuery("q contains control or invisible characters; send the words to search for.")
    if not search_terms(query):
        raise InvalidQuery(f"q={query.strip()!r} has no searchable words (only very common words such as 'the').")
    return query.strip()


def clean_limit(limit: Any) -> int | None:
    if limit is None:
        return None
    if limit == "":
        # `?limit=` is a value that is not a number, not the default.
        raise InvalidLimit("limit is empty: give a whole number, or leave the parameter out.")
    try:
        number = int(limit)
    except (TypeError, ValueError):
        raise InvalidLimit(f"limit={limit!r} is not a whole number.") from None
    if not 1 <= number <= MAX_RESULTS:
        raise InvalidLimit(f"limit must be between 1 and {MAX_RESULTS}.")
    return number


# --- Writing ----------------------------------------------------------------------------------------------


def ingest(*, agent: str, owner_id: str, items: Sequence[Remembered]) -> int:
    """Store the items in the scope; an event already stored is skipped. Returns how many are new.

    One `INSERT … ON CONFLICT DO NOTHING RETURNING`: the unique (agent, owner, event) constraint
    skips what is stored already (and settles a race with a concurrent writer), and the rows that
    come back are the new ones. No read first. Django's bulk_create(ignore_conflicts=True) can
    not say which rows went in, hence the SQL (SQLite has RETURNING from 3.35).
    """
    if not items:
        return 0
    by_event = list({item.event_id: item for item in items}.values())
    now = timezone.now()
    return sum(
        _insert_new(agent=agent, owner_id=owner_id, items=by_event[start : start + INGEST_CHUNK], now=now)
        for start in range(0, len(by_event), INGEST_CHUNK)
    )


# Rows per INSERT: nine parameters each, far below SQLite's limit of 32766.
INGEST_CHUNK = 500


def _insert_new(*, agent: str, owner_id: str, items: Sequence[Remembered], now: datetime) -> int:
    connection = connections[MemoryEntry.objects.db]
    fields = [MemoryEntry._meta.get_field(name) for name in _INGESTED]
    rows = []
    params: list[Any] = []
    for item in items:
        values = {
            "agent_name": agent, "owner_id": owner_id, "event_id": item.event_id, "author": item.author,
            "text": item.text, "session_id": item.session_id, "run_id": item.run_id,
            "timestamp": item.timestamp, "added_at": now,
        }
        rows.append(f"({', '.join(['%s'] * len(fields))})")
        params.extend(field.get_db_prep_save(values[field.name], connection) for field in fields)
    quote = connection.ops.quote_name
    sql = (
        f"INSERT INTO {quote(MemoryEntry._meta.db_table)} ({', '.join(quote(field.column) for field in fields)}) "
        f"VALUES {', '.join(rows)} ON CONFLICT ({', '.join(quote(name) for name in _SCOPE_EVENT)}) DO NOTHING "
        f"RETURNING {quote('id')}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return len(cursor.fetchall())


_INGESTED = ("agent_name", "owner_id", "event_id", "author", "text", "session_id", "run_id", "timestamp", "added_at")
# The columns of the unique constraint memory_scope_event.
_SCOPE_EVENT = ("agent_name", "owner_id", "event_id")


def remember_session(*, agent: str, owner_id: str, session_id: str, invocation_id: str, run_id: uuid.UUID) -> int:
    """Add what one invocation's user and agent said (as stored in its session) to the (agent, owner) scope.

    Idempotent: feeding the same invocation again stores nothing new. The caller decides what is
    worth remembering (the ledger feeds successful runs only).
    """
    rows = AdkEvent.objects.of_invocation(
        app_name=agent, user_id=owner_id, session_id=session_id, invocation_id=invocation_id
    )
    events = [Event.model_validate({**row.event_data, "id": row.id}) for row in rows if row.event_data]
    return remember_events(
        agent=agent, owner_id=owner_id, session_id=session_id, invocation_id=invocation_id, run_id=run_id,
        events=events,
    )


def remember_events(
    *, agent: str, owner_id: str, session_id: str, invocation_id: str, run_id: uuid.UUID, events: Sequence[Event]
) -> int:
    """Add one invocation's events to its scope's memory; idempotent like remember_session.

    The worker passes the events ADK yielded, so remembering costs no read of the session.
    """
    items = memories_from_events(
        [event for event in events if event.invocation_id == invocation_id],
        session_id=session_id,
        run_id=run_id,
    )
    # The worker already holds a savepoint around this call: a second one would only add a
    # SAVEPOINT and a RELEASE to every successful run.
    with transaction.atomic(savepoint=False):
        added = ingest(agent=agent, owner_id=owner_id, items=items)
    logger.info("Run %s: %d new memories for %s/%s", run_id, added, agent, owner_id)
    return added


# --- Reading ----------------------------------------------------------------------------------------------


def compiled_search(*, agent: str, owner_id: str, query: str) -> tuple[str, tuple] | None:
    """`search_memories` as (sql, params) of `memory.search.RANKED_COLUMNS` rows, for a caller that
    sends it on a connection of its own (PostgreSQL); None when nothing can match."""
    if not agent or not owner_id:
        raise ScopeRequired("A memory scope needs both an agent and an owner_id.")
    return search.compiled_ranked(
        MemoryEntry.objects, agent=agent, owner_id=owner_id, query=query, limit=settings.MEMORY_SEARCH_RESULTS
    )


def search_memories(*, agent: str, owner_id: str, query: str, limit: int | None = None) -> list[MemoryEntry]:
    """The scope's memories most relevant to `query`, best first (at most `limit`)."""
    limit = settings.MEMORY_SEARCH_RESULTS if limit is None else max(1, min(limit, MAX_RESULTS))
    return MemoryEntry.objects.for_scope(agent=agent, owner_id=owner_id).search(query, limit=limit)


# --- Forgetting -------------------------------------------------------------------------------------------


def delete_memory(*, agent: str, owner_id: str, memory_id: str) -> int:
    """Delete one memory of the scope by the id search results carry."""
    deleted, _ = MemoryEntry.objects.for_scope(agent=agent, owner_id=owner_id).filter(event_id=memory_id).delete()
    return deleted


def forget_owner(*, owner_id: str, agent: str | None = None) -> int:
    """Delete every memory of an owner (of one agent, or of all). Returns how many went."""
    owner_id = _check_scope_value("owner_id", owner_id)
    entries = MemoryEntry.objects.filter(owner_id=owner_id)
    if agent is not None:
        entries = entries.filter(agent_name=_check_scope_value("agent", agent))
    deleted, _ = entries.delete()
    logger.info("Forgot %d memories of owner %r%s", deleted, owner_id, f" (agent {agent})" if agent else "")
    return deleted


def prune_memories(*, now: datetime | None = None, retention_days: int | None = None) -> int:
    """Delete memories older than MEMORY_RETENTION_DAYS, in batches; unset keeps them for ever."""
    days = settings.MEMORY_RETENTION_DAYS if retention_days is None else retention_days
    if not days:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    batch = settings.PURGE_BATCH_SIZE
    total = 0
    while True:
        ids = list(MemoryEntry.objects.older_than(cutoff).order_by().values_list("id", flat=True)[:batch])
        if not ids:
            break
        deleted, _ = MemoryEntry.objects.filter(id__in=ids).delete()
        total += deleted
    if total:
        logger.info("Pruned %d memories older than %s", total, cutoff.isoformat())
    return total
