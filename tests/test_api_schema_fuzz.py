"""The API tells the truth about itself: schemathesis, every check, against the app's own schema.

The schema is loaded from `/api/schema/` and every operation is called in-process through the
WSGI app, on the test database, as a superuser with a DRF token. Generation is derandomized and
bounded, so a run is repeatable. The full budget (12 examples an operation) is spent once per CI
run, on PostgreSQL; CI's SQLite leg skips it (API_FUZZ=off); a local run on SQLite spends 2.

Three formats of the schema name rules no JSON Schema keyword can state, and the fuzzer is told
what they mean here: `printable` (not blank, no character of Unicode's category C), `cursor`
(the `next`/`previous` links of a page this API answered) and `search-words` (a memory query
with at least one word that is not a very common one).

Runs the fuzzer starts are only written and enqueued (the broker is the database, and no worker
runs here): no agent runs in this process.
"""

from __future__ import annotations

import base64
import itertools
import os
import re
import unicodedata
import uuid
from datetime import UTC
from urllib.parse import urlencode

import jsonschema
import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections, connection
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from rest_framework.authtoken.models import Token
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.config._checks import POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES, PositiveDataAcceptanceConfig

from agents import services as agent_services
from agents.demo import DEMO_WORKFLOW
from memory import services as memory_services
from runs.models import AgentRun, RunStatus
from tests.factories import make_run, with_journal

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

SEEDED_RUN_IDS = [uuid.UUID(int=n) for n in (0x5EED1, 0x5EED2, 0x5EED3)]


def _printable(text: str) -> bool:
    return bool(text.strip()) and not any(unicodedata.category(ch).startswith("C") for ch in text)


schemathesis.openapi.format(
    "printable", st.text(st.characters(exclude_categories=["C"]), min_size=1, max_size=40).filter(_printable)
)
schemathesis.openapi.format(
    "cursor",
    st.builds(
        lambda offset, reverse, position: base64.b64encode(
            urlencode({"o": offset, "r": int(reverse), **({"p": position} if position else {})}).encode()
        ).decode(),
        st.integers(min_value=0, max_value=50),
        st.booleans(),
        st.none() | st.datetimes(timezones=st.just(UTC)).map(lambda at: at.isoformat()),
    ),
)


schemathesis.openapi.format(
    "search-words",
    st.text(st.characters(exclude_categories=["C"]), min_size=1, max_size=40).filter(
        lambda text: _printable(text) and bool(memory_services.search_terms(text))
    ),
)


_written = itertools.count(1)


def workflow_made_valid(case):
    """A valid workflow body, made valid in what its schema cannot say.

    The schema states the graph's shape; that chains name the steps, lead from START without a
    cycle and end once, and that a name is new, are rules no JSON Schema can state. A positive
    body keeps its generated name (made new), step names and options, as one chain of agent steps.
    """
    body = case.body
    steps = {}
    for index, (name, spec) in enumerate(body["graph"]["steps"].items()):
        options = {key: spec[key] for key in ("retry", "timeout") if key in spec}
        steps[name if re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,63}", name) else f"step{index}"] = {
            "agent": "support", **options
        }
    suffix = f"_{next(_written)}"
    case.body = {
        **body,
        "name": body["name"][: 64 - len(suffix)] + suffix,
        "graph": {"steps": steps, "chains": [["START", *steps]]},
    }


def _valid(operation, body) -> bool:
    media = operation.get_body_for_media_type("application/json")
    return media is not None and jsonschema.Draft4Validator(media.optimized_schema).is_valid(body)


@schemathesis.hook
def filter_failure(context, failure, case, response):
    """Keep every failure but one schemathesis cannot judge: a "schema-violating" multipart body
    whose fields, read as the text a form sends, satisfy the schema (a number in a form field is
    the text of a string), when a file part keeps schemathesis from reading the form."""
    media_type = case.media_type or ""
    if failure.code != "ST201" or not media_type.startswith("multipart/") or not isinstance(case.body, dict):
        return True
    media = case.operation.get_body_for_media_type(media_type)
    as_sent = {
        name: value if isinstance(value, dict | list) else str(value).lower() if isinstance(value, bool) else str(value)
        for name, value in case.body.items()
        if name != "file" and value is not None
    }
    schema = {**media.optimized_schema, "properties": {
        name: prop for name, prop in media.optimized_schema.get("properties", {}).items() if name != "file"}}
    return not jsonschema.Draft4Validator(schema).is_valid(as_sent)


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
    """Runs and a workflow for the responses to show: nobody started them, forced or cancelled them."""
    runs = [
        make_run(status=RunStatus.ERROR, tools=["lookup_customer", "send_email"]),
        make_run(status=RunStatus.SUCCESS, tools=[], result="Done."),
        make_run(status=RunStatus.QUEUED),
    ]
    for run, run_id in zip(runs, SEEDED_RUN_IDS, strict=True):
        AgentRun.objects.filter(pk=run.pk).update(run_id=run_id)
    with_journal(AgentRun.objects.get(pk=SEEDED_RUN_IDS[0]),
                 [("lookup_customer", "read_only", "answered"), ("send_email", "idempotent", "called")])
    # Not the demo's own name: the schema's example creates that one.
    agent_services.save_workflow(name="seeded_review", graph=DEMO_WORKFLOW["graph"], description="Seeded.")
    return SEEDED_RUN_IDS


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
# single document schemathesis can validate. tests/test_chat.py drives it on a real server.
schema = schemathesis.pytest.from_fixture("api_schema").exclude(path="/api/chat/")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
def test_every_operation_answers_as_its_schema_says(case, superuser_token, seeded):
    if case.meta is not None and case.meta.generation.mode.is_positive and "run_id" in (case.path_parameters or {}):
        # Valid requests about runs that exist, so their answers (not only 404s) are checked too.
        case.path_parameters["run_id"] = str(seeded[len(repr(case.body)) % len(seeded)])
    if (
        case.meta is not None
        and case.meta.generation.mode.is_positive
        and case.path in ("/api/workflows/", "/api/workflows/{name}/")
        and case.method.upper() in ("POST", "PUT")
        and isinstance(case.body, dict)
        and _valid(case.operation, case.body)
    ):
        workflow_made_valid(case)
    case.call_and_validate(headers={"Authorization": f"Token {superuser_token}"}, checks=ALL_CHECKS)
    assert not AgentRun.objects.filter(status=RunStatus.RUNNING).exists(), "an agent ran in the web process"

