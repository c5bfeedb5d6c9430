"""django-q2 entry points for long-term memory. Each is safe to run twice."""

from memory import services


def prune_memories() -> int:
    """The daily retention job: deletes memories older than MEMORY_RETENTION_DAYS (if set)."""
    return services.prune_memories()
