from django.apps import AppConfig
from django.conf import settings
from django.db.backends.signals import connection_created

from config.lib.files import make_sqlite_files_private
from config.lib.observability import configure_from_settings


class RunsConfig(AppConfig):
    name = "runs"
    verbose_name = "Run ledger"

    def ready(self) -> None:
        # Registers the journal's hook on ADK's event rows in every process that stores events.
        from agents.session_sql import install_append_fence, install_append_rider
        from runs.ledger import journal, leases

        # An event of a run is stored only while its attempt still holds the run.
        install_append_fence(leases.EventFence())
        # A function response's journal rows are written by its event's own statement.
        install_append_rider(journal.AnswersRider())
        # The SQLite files hold API tokens, sessions and webhook secrets: 0600 from the first connection.
        connection_created.connect(make_sqlite_files_private, dispatch_uid="config.lib.files.sqlite_private")

        # Before the first request is handled: Django's request spans need their middleware.
        configure_from_settings(settings)
