from __future__ import annotations

from django.db import models
from django.utils import timezone

from memory import search


class ScopeRequired(RuntimeError):
    """A memory search was attempted without saying whose memories to search."""


class MemoryEntryQuerySet(models.QuerySet):
    """Memories, with the one filter that keeps each owner's memories to that owner.

    Every path that serves memories to an agent or to an API caller starts from
    `for_scope(agent=..., owner_id=...)`; `search()` refuses a queryset that did not, so a
    forgotten filter is an immediate error instead of a leak.
    """

    _memory_scope: tuple[str, str] | None = None

    def _clone(self):
        clone = super()._clone()
        clone._memory_scope = self._memory_scope
        return clone

    def for_scope(self, *, agent: str, owner_id: str) -> MemoryEntryQuerySet:
        if not agent or not owner_id:
            raise ScopeRequired("A memory scope needs both an agent and an owner_id.")
        scoped = self.filter(agent_name=agent, owner_id=owner_id)
        scoped._memory_scope = (agent, owner_id)
        return scoped

    @property
    def scope(self) -> tuple[str, str] | None:
        return self._memory_scope

    def matching(self, query: str) -> MemoryEntryQuerySet:
        """Entries whose text matches any searchable word of `query`, through the full-text index.

        Unranked and unscoped: the admin uses it over the rows a staff member is filtering.
        """
        return search.matching(self, query)

    def search(self, query: str, *, limit: int) -> list[MemoryEntry]:
        """The scope's entries ranked by relevance to `query`, best first."""
        if self._memory_scope is None:
            raise ScopeRequired("Memory search must go through MemoryEntry.objects.for_scope(agent=, owner_id=).")
        return list(search.ranked(self, query)[:limit])

    def older_than(self, cutoff) -> MemoryEntryQuerySet:
        return self.filter(timestamp__lt=cutoff)


class MemoryEntry(models.Model):
    """One remembered event (a user message or a model answer) of one agent for one owner.

    The full-text index lives outside Django's model state because it differs per database:
    a generated tsvector column under a GIN index on PostgreSQL, an FTS5 table kept in step by
    triggers on SQLite (memory.fulltext, applied by migration 0002_full_text_search).
    """

    agent_name = models.CharField(max_length=128)
    owner_id = models.CharField(max_length=128)
    # ADK's event id (or a content hash for memories written directly): ingestion is
    # idempotent on (agent_name, owner_id, event_id).
    event_id = models.CharField(max_length=128)
    author = models.CharField(max_length=128)
    text = models.TextField()
    session_id = models.CharField(max_length=128, blank=True)
    # A plain UUID, like the demo tools' records: a memory may come from outside a run, and
    # removing a memory never touches the ledger.
    run_id = models.UUIDField(null=True, blank=True)
    timestamp = models.DateTimeField(help_text="When the remembered event happened.")
    added_at = models.DateTimeField(default=timezone.now)

    objects = MemoryEntryQuerySet.as_manager()

    class Meta:
        db_table = "memory_entries"
        ordering = ["-timestamp", "-id"]
        verbose_name = "memory"
        verbose_name_plural = "memories"
        constraints = [
            models.UniqueConstraint(fields=["agent_name", "owner_id", "event_id"], name="memory_scope_event"),
        ]
        indexes = [
            models.Index(fields=["agent_name", "owner_id", "-timestamp"], name="memory_scope_time"),
            models.Index(fields=["owner_id"], name="memory_owner"),
            models.Index(fields=["timestamp"], name="memory_time"),
            models.Index(fields=["run_id"], name="memory_run"),
        ]

    def __str__(self) -> str:
        return f"{self.agent_name}/{self.owner_id}: {self.text[:60]}"
