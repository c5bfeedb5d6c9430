from django.apps import AppConfig
from django.db.models.signals import post_migrate


def _ensure_adk_tables(sender, using="default", **kwargs) -> None:
    # ADK creates its tables lazily on first use; doing it at migrate time means the admin and
    # the purge can read them from the first request on, and a bad DATABASE_URL fails early.
    if using != "default":
        return
    from agents.adk import ensure_adk_tables

    ensure_adk_tables()


class AgentsConfig(AppConfig):
    name = "agents"
    verbose_name = "Agents"

    def ready(self) -> None:
        post_migrate.connect(_ensure_adk_tables, sender=self, dispatch_uid="agents.ensure_adk_tables")
