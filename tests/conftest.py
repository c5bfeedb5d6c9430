"""Shared fixtures and personas.

Runs cross the seam between Django's connection and ADK's own engine, so tests that execute
agents use real commits (`transactional_db`). Child processes (crash tests, restarts) get the
same test database through `child_env()`.
"""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connections, transaction
from django.test import TransactionTestCase

from tests.kit import with_permissions

# --- Emptying the database after a test that committed ------------------------------------------

# What post_migrate writes and no test changes: kept, so the signal need not run after each test.
_KEPT_TABLES = {ContentType._meta.db_table, Permission._meta.db_table}
_flush_tables: dict[str, list[str]] = {}


def _delete_committed_rows(self) -> None:
    """TransactionTestCase's teardown, as DELETEs instead of `manage.py flush`.

    flush TRUNCATEs every table (on PostgreSQL a new file per table: ~0.25 s a test here, ~8x a
    typical test) and then runs post_migrate, which rebuilds content types and permissions and
    makes ADK's tables again (another engine and connection). A test leaves a handful of rows, so
    deleting them, constraints deferred to the commit, ends in the same empty database for a
    fraction of the cost. Tests that ask for serialized rollback or a subset of apps keep
    Django's own way.
    """
    if self.available_apps is not None or self.serialized_rollback:
        return _django_fixture_teardown(self)
    for db_name in self._databases_names(include_mirrors=False):
        connection = connections[db_name]
        if db_name not in _flush_tables:
            _flush_tables[db_name] = [
                table
                for table in connection.introspection.django_table_names(only_existing=True, include_views=False)
                if table not in _KEPT_TABLES
            ]
        with transaction.atomic(using=db_name), connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SET CONSTRAINTS ALL DEFERRED")
            for table in _flush_tables[db_name]:
                cursor.execute(f"DELETE FROM {connection.ops.quote_name(table)}")


_django_fixture_teardown = TransactionTestCase._fixture_teardown


@pytest.fixture(scope="session", autouse=True)
def _cheap_flush():
    TransactionTestCase._fixture_teardown = _delete_committed_rows
    yield
    TransactionTestCase._fixture_teardown = _django_fixture_teardown


@pytest.fixture(scope="session", autouse=True)
def _release_adk_connections(django_db_setup, django_db_blocker):
    yield
    # Pooled ADK connections and the ORM thread's connection would keep the test database
    # open and make dropping it fail on PostgreSQL.
    from agents.adk import release_process_resources

    with django_db_blocker.unblock():
        release_process_resources()
        from django.db import connection

        if connection.vendor == "postgresql":
            # Child processes killed with SIGKILL, or threads a test started, may still hold a
            # session on the test database; end them so it can be dropped.
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            connection.close()


@pytest.fixture(autouse=True)
def _test_settings(settings, tmp_path):
    # Hashing a persona's password with the production hasher costs ~0.3 s a user.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.SCRIPTED_FAULTS_ENABLED = True
    settings.SCRIPTS_FROM_USERS_ALLOWED = True
    # Limits are tested where they are the subject (tests/config/test_limits.py); elsewhere a test may
    # start many runs and log in as it likes.
    settings.THROTTLE_RATES = {scope: None for scope in settings.THROTTLE_RATES}
    settings.AXES_ENABLED = False
    # A cache per test: throttle history never leaks from one test into the next.
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": f"test-{uuid.uuid4()}"}
    }
    settings.RUN_INPUTS_DIR = tmp_path / "run-inputs"
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.RUN_HEARTBEAT_SECONDS = 0.2
    # A heartbeat of its own for each test: the thread an earlier test left behind (its runs still
    # finishing as it ended) may be sleeping out the 10 s interval that test's teardown restored,
    # and this test's runs would not beat until it woke.
    from runs.execution import heartbeat

    heartbeat._state.update(pid=None, heartbeat=None)


@pytest.fixture
def no_worker(monkeypatch):
    """No worker runs in this test: runs started are written but not enqueued (the broker stays
    empty), so nothing executes behind the test's back."""
    from runs.ledger import lifecycle

    monkeypatch.setattr(lifecycle, "announce_run", lambda run_id: None)


@pytest.fixture
def announced(monkeypatch) -> list:
    """No worker runs in this test: the run ids announced to the workers, recorded in order."""
    from runs.ledger import lifecycle

    run_ids: list = []
    monkeypatch.setattr(lifecycle, "announce_run", run_ids.append)
    return run_ids


@pytest.fixture
def no_inbox_worker(monkeypatch):
    """No worker works the inbox in this test: webhook events received are stored, never announced."""
    from runs.inbox import receipt

    monkeypatch.setattr(receipt, "announce_event", lambda event_id: None)


@pytest.fixture
def announced_events(monkeypatch) -> list[str]:
    """Webhook events the inbox announces to the workers, recorded (no worker runs here: tests process them directly)."""
    from runs.inbox import receipt

    event_ids: list[str] = []
    monkeypatch.setattr(receipt, "announce_event", lambda event_id: event_ids.append(str(event_id)))
    return event_ids


# --- Personas -------------------------------------------------------------------------------------


@pytest.fixture
def alice(django_user_model):
    """An internal tool's account: starts runs for its end users (runs.act_for_any_owner) and sees its own;
    its test suites place scripted tool faults (runs.place_tool_faults)."""
    user = django_user_model.objects.create_user("alice", password="alice-pass-123")
    user.user_permissions.add(*Permission.objects.filter(codename__in=["act_for_any_owner", "place_tool_faults"]))
    return user


@pytest.fixture
def bob(django_user_model):
    """An ordinary user: acts only for himself (owner "bob") and for owners an admin granted him."""
    return django_user_model.objects.create_user("bob", password="bob-pass-123")


# The desk's permissions (docs/architecture.md, "Who may act for whom"): seeing every run, and
# replaying, cancelling and resolving what others started.
DESK = ["view_agentrun", "view_toolcall", "replay_agentrun", "cancel_agentrun", "resolve_webhookevent"]


@pytest.fixture
def support_agent(django_user_model):
    """Support staff: sees every run in the admin, may replay and cancel anyone's run but not force."""
    user = django_user_model.objects.create_user("sam", password="sam-pass-123", is_staff=True)
    return with_permissions(user, DESK)


@pytest.fixture
def support_lead(django_user_model):
    """Senior support: may also force a replay the rules refuse."""
    user = django_user_model.objects.create_user("lee", password="lee-pass-123", is_staff=True)
    return with_permissions(user, [*DESK, "force_replay_agentrun"])


@pytest.fixture
def run_viewer(django_user_model):
    """May read every run (runs.view_agentrun) and nothing more: seeing is not acting."""
    user = django_user_model.objects.create_user("vera", password="vera-pass-123", is_staff=True)
    return with_permissions(user, ["view_agentrun", "view_toolcall"])


@pytest.fixture
def bare_staff(django_user_model):
    """Staff without model permissions: sees and acts on only their own runs, in the API as in the admin."""
    return django_user_model.objects.create_user("stan", password="stan-pass-123", is_staff=True)


@pytest.fixture
def agents_dir(settings, tmp_path):
    """Load agent packages written by the test, through AGENTS_DIR (beside the bundled ones).

    `agents_dir(desk=source, …)` writes `<tmp>/agents/<name>/agent.py` for each, points
    AGENTS_DIR at the bundled directory and that one, and reloads the registry; the registry
    and the import system are put back afterwards.
    """
    from agents import registry
    from tests.helpers import forget_agent_packages, write_agent_packages

    directory = tmp_path / "agents"
    directory.mkdir()
    written: list[str] = []
    original = list(settings.AGENTS_DIR)

    def load(**packages: str) -> dict:
        write_agent_packages(directory, packages)
        written.extend(packages)
        forget_agent_packages(directory, written)
        settings.AGENTS_DIR = [*original, str(directory)]
        return registry.AGENTS.reload()

    yield load
    forget_agent_packages(directory, written)
    settings.AGENTS_DIR = original
    registry.AGENTS.reload()


@pytest.fixture
def model_down_at_second_call(monkeypatch):
    """The model provider fails at the run's second model call; `restore()` brings it back."""
    from agents import scripted

    original = scripted.ScriptedLlm.generate_content_async

    async def down(self, llm_request, stream=False):
        if self.calls_made >= 1:
            raise scripted.ScriptedModelError("The provider is down.")
        async for response in original(self, llm_request, stream):
            yield response

    monkeypatch.setattr(scripted.ScriptedLlm, "generate_content_async", down)
    return lambda: monkeypatch.setattr(scripted.ScriptedLlm, "generate_content_async", original)


@pytest.fixture
def requests_seen():
    """Every request the scripted model receives (ADK's LlmRequest), from now on; `clear()` it to
    watch one stretch."""
    from agents import scripted

    seen: list = []
    scripted.request_observers.append(seen.append)
    yield seen
    scripted.request_observers.remove(seen.append)


@pytest.fixture
def model_requests():
    """Every request the scripted model receives, as the text of its contents."""
    from agents import scripted

    seen: list[str] = []

    def observe(request) -> None:
        seen.append("\n".join(part.text or "" for content in request.contents for part in content.parts or []))

    scripted.request_observers.append(observe)
    yield seen
    scripted.request_observers.remove(observe)
