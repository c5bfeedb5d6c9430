"""ADK's BaseMemoryService on `memory.MemoryEntry`.

ADK's `app_name` is the agent's name and its `user_id` is the run's owner, so ADK's scope is
exactly ours. Database work runs through `sync_to_async`, on the ORM thread the rest of the
agent loop already uses.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from asgiref.sync import sync_to_async
from django.db import connection
from django.utils import timezone
from google.adk.events.event import Event
from google.adk.memory.base_memory_service import BaseMemoryService, SearchMemoryResponse
from google.adk.memory.memory_entry import MemoryEntry as AdkMemoryEntry
from google.adk.sessions.session import Session
from google.genai import types

from agents.adk import session_service
from memory import services
from memory.models import MemoryEntry

logger = logging.getLogger(__name__)


def to_adk(entry: MemoryEntry) -> AdkMemoryEntry:
    return AdkMemoryEntry(
        id=entry.event_id,
        author=entry.author,
        timestamp=entry.timestamp.isoformat(),
        content=types.Content(
            role="user" if entry.author == "user" else "model",
            parts=[types.Part(text=entry.text)],
        ),
        custom_metadata={
            "session_id": entry.session_id,
            "run_id": str(entry.run_id) if entry.run_id else None,
        },
    )


def _row_to_adk(row) -> AdkMemoryEntry:
    """`to_adk` of a row of `memory.search.RANKED_COLUMNS`."""
    event_id, author, timestamp, text, session_id, run_id = row
    return AdkMemoryEntry(
        id=event_id,
        author=author,
        timestamp=timestamp.astimezone(UTC).isoformat(),
        content=types.Content(role="user" if author == "user" else "model", parts=[types.Part(text=text)]),
        custom_metadata={"session_id": session_id, "run_id": str(run_id) if run_id else None},
    )


def _parse_time(value: str | None) -> datetime:
    if value:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            parsed = None
        if parsed is not None:
            return parsed if timezone.is_aware(parsed) else parsed.replace(tzinfo=UTC)
    return timezone.now()


def _from_adk_entries(entries: Sequence[AdkMemoryEntry], custom_metadata: Mapping[str, object] | None):
    metadata = dict(custom_metadata or {})
    items = []
    for entry in entries:
        text = services.scrub(
            "\n".join(part.text for part in (entry.content.parts or []) if part.text and not part.thought)
        )
        if not text:
            continue
        author = (entry.author or "user")[: services.MAX_SCOPE_CHARS]
        when = _parse_time(entry.timestamp)
        entry_metadata = {**metadata, **(entry.custom_metadata or {})}
        items.append(
            services.Remembered(
                event_id=entry.id or services.content_hash(author, text, entry.timestamp or ""),
                author=author,
                text=text,
                timestamp=when,
                session_id=str(entry_metadata.get("session_id") or "")[: services.MAX_SCOPE_CHARS],
                run_id=services.as_uuid(entry_metadata.get("run_id")),
            )
        )
    return items


class LedgerMemoryService(BaseMemoryService):
    """Long-term memory in the application database, scoped by (agent, owner)."""

    async def add_session_to_memory(self, session: Session) -> None:
        await self.add_events_to_memory(
            app_name=session.app_name, user_id=session.user_id, events=session.events, session_id=session.id
        )

    async def add_events_to_memory(
        self,
        *,
        app_name: str,
        user_id: str,
        events: Sequence[Event],
        session_id: str | None = None,
        custom_metadata: Mapping[str, object] | None = None,
    ) -> None:
        run_id = (custom_metadata or {}).get("run_id")
        items = services.memories_from_events(
            events, session_id=session_id or "", run_id=services.as_uuid(run_id)
        )
        await sync_to_async(services.ingest)(agent=app_name, owner_id=user_id, items=items)

    async def add_memory(
        self,
        *,
        app_name: str,
        user_id: str,
        memories: Sequence[AdkMemoryEntry],
        custom_metadata: Mapping[str, object] | None = None,
    ) -> None:
        items = _from_adk_entries(memories, custom_metadata)
        await sync_to_async(services.ingest)(agent=app_name, owner_id=user_id, items=items)

    async def search_memory(self, *, app_name: str, user_id: str, query: str) -> SearchMemoryResponse:
        store = session_service() if connection.vendor == "postgresql" else None
        if store is not None and store.dialect == "postgresql":
            # On the loop's own connection: no hop to the ORM thread, a statement psycopg
            # prepares, and no model object for a row that is only sent.
            compiled = services.compiled_search(agent=app_name, owner_id=user_id, query=query)
            if compiled is None:
                return SearchMemoryResponse(memories=[])
            sql, params = compiled
            rows = await store.on_own_connection(lambda conn: conn.exec_driver_sql(sql, params).all(), autocommit=True)
            return SearchMemoryResponse(memories=[_row_to_adk(row) for row in rows])
        entries = await sync_to_async(services.search_memories)(agent=app_name, owner_id=user_id, query=query)
        return SearchMemoryResponse(memories=[to_adk(entry) for entry in entries])

    async def delete_memory(self, *, app_name: str, user_id: str, memory_id: str | None = None) -> None:
        # Like ADK's own services, no id means nothing to delete; forgetting a whole owner is
        # memory.services.forget_owner.
        if not memory_id:
            return
        await sync_to_async(services.delete_memory)(agent=app_name, owner_id=user_id, memory_id=memory_id)


_service = LedgerMemoryService()


def memory_service() -> LedgerMemoryService:
    """The memory service every runner gets. It holds no state, so one serves every loop."""
    return _service
