from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    verbose_name = "Run ledger"

    def ready(self) -> None:
        # Registers the journal's hook on ADK's event rows in every process that stores events.
        from runs import journal  # noqa: F401
