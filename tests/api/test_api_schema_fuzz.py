"""The API tells the truth about itself: schemathesis, every check, against the app's own schema.

The schema is loaded from `/api/schema/` and every operation is called in-process through the
WSGI app, on the test database, as a superuser with a DRF token. Generation is derandomized and
bounded, so a run is repeatable. The full budget (12 examples an operation) is spent once per CI
run, on PostgreSQL; CI's SQLite leg skips it (API_FUZZ=off); a local run on SQLite spends 2. What
the fuzzer is told about the API (formats, valid workflow bodies, seeded runs) is `tests.fuzz_hooks`,
shared with the run against a live production-like server (`.ci/schemathesis-live`).

Runs the fuzzer starts are only written and enqueued (the broker is the database, and no worker
runs here): no agent runs in this process.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections, connection
from hypothesis import HealthCheck, settings
from rest_framework.authtoken.models import Token
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.config._checks import POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES, PositiveDataAcceptanceConfig

from runs.models.ledger import AgentRun, RunStatus
from tests.fuzz_hooks import prepare, seed

load_all_checks()
# Every check schemathesis has, by name: no server errors, response schema, status codes, content
# types and headers, negative data rejected, positive data accepted, missing headers, methods,
# Allow headers, auth, resources.
ALL_CHECKS = [CHECKS.get_one(name) for name in CHECKS.get_all_names()]

EXAMPLES_PER_OPERATION = 12 if connection.vendor == "postgresql" else 2
# CI runs the suite on both databases and fuzzes on PostgreSQL only: its SQLite leg sets this to
# "off" (the fuzzer is most of that leg's time). A local `make test` on SQLite still fuzzes.
FUZZ_OFF = os.environ.get("API_FUZZ", "").lower() == "off"
# Minutes of generated requests: not for the inner loop.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(FUZZ_OFF, reason="API_FUZZ=off: fuzzed on the other database")]


@pytest.fixture(autouse=True)
def _schemathesis_on_pytest_9(request):
    # schemathesis 4.32's lazy loader reads and writes `node._nodeid`, which pytest 9 renamed.
    request.node._nodeid = request.node.nodeid


@pytest.fixture
def superuser_token(db, django_user_model, settings):
    # Production's default: API users may not send scripts (the schema then says so).
    settings.SCRIPTS_FROM_USERS_ALLOWED = False
    user = django_user_model.objects.create_superuser("fuzz", password="fuzz-pass-123")
    return Token.objects.create(user=user).key


@pytest.fixture
def seeded(db):
    return seed()


@pytest.fixture
def wsgi_app(db):
    # As Django's test client does: a request must not close the test's database connection.
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield get_wsgi_application()
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture
def api_schema(wsgi_app, superuser_token, seeded):
    loaded = schemathesis.openapi.from_wsgi(
        "/api/schema/", wsgi_app, headers={"Authorization": f"Token {superuser_token}"}
    )
    # The API refuses NUL in any text it reads, at the parser (config/lib/safe_json.py).
    loaded.config.generation.update(allow_x00=False)
    # A valid request about a run may be refused by the run's state: 409 (it is in flight, it succeeded…)
    # and 410 (its input copy or its session events are gone), both documented on those operations.
    loaded.config.checks.positive_data_acceptance = PositiveDataAcceptanceConfig(
        expected_statuses=[*POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES, "410"]
    )
    return loaded


# The chat turn is in the schema (a text/event-stream answer, JSON refusals) but not fuzzed here:
# a valid turn runs its agent inside the web process, as chat does by design, and a stream is no
# single document schemathesis can validate. tests/chat/test_chat.py drives it on a real server.
schema = schemathesis.pytest.from_fixture("api_schema").exclude(path="/api/chat/")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
def test_every_operation_answers_as_its_schema_says(case, superuser_token, seeded):
    prepare(case)
    case.call_and_validate(headers={"Authorization": f"Token {superuser_token}"}, checks=ALL_CHECKS)
    assert not AgentRun.objects.filter(status=RunStatus.RUNNING).exists(), "an agent ran in the web process"

