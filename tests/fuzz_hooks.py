"""What the fuzzer is told about this API, shared by the in-process fuzz test and the live run.

Four formats of the schema name rules no JSON Schema keyword can state, and the fuzzer is told
what they mean here: `printable` (not blank, no character of Unicode's category C),
`plain-words` (a person's note: no control character but line breaks and tabs, nothing invisible), `cursor`
(the `next`/`previous` links of a page this API answered) and `search-words` (a memory query
with at least one word that is not a very common one). `prepare` makes a positive case about a
run name one of the seeded runs, a positive start name an agent or workflow that still exists,
and a positive workflow body a valid graph; `filter_failure` drops the one failure schemathesis
cannot judge. Importing this module registers all of it (`SCHEMATHESIS_HOOKS=tests.fuzz_live`
loads it for the command line).
"""

from __future__ import annotations

import base64
import itertools
import keyword
import re
import unicodedata
import uuid
from datetime import UTC
from urllib.parse import urlencode

import jsonschema
import schemathesis
from hypothesis import strategies as st

from agents import services as agent_services
from agents.demo import DEMO_WORKFLOW
from agents.models import WorkflowDefinition
from agents.registry import AGENTS
from agents.workflows import WorkflowGraphError
from config.lib.text import hidden_character
from memory import services as memory_services
from runs.models.ledger import AgentRun, RunStatus
from tests.factories import make_run, with_journal

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
    "plain-words",
    st.text(
        st.characters(exclude_categories=["Cc", "Cf", "Cs"]) | st.sampled_from("\n\t"), min_size=1, max_size=80
    ).filter(lambda text: bool(text.strip()) and hidden_character(text) is None),
)
schemathesis.openapi.format(
    "search-words",
    st.text(st.characters(exclude_categories=["C"]), min_size=1, max_size=40).filter(
        lambda text: _printable(text) and bool(memory_services.search_terms(text))
    ),
)


_written = itertools.count(1)
# Names stay new across processes too: the live run's database outlives a run.
_RUN_MARK = uuid.uuid4().hex[:6]


def workflow_made_valid(case):
    """A valid workflow body, made valid in what its schema cannot say.

    The schema states the graph's shape; that chains name the steps, lead from START without a
    cycle and end once, that a step name is no Python keyword, and that a name is new, are rules no
    JSON Schema can state. A positive body keeps its generated name (made new), step names and
    options, as one chain of agent steps.
    """
    body = case.body
    steps = {}
    for index, (name, spec) in enumerate(body["graph"]["steps"].items()):
        options = {key: spec[key] for key in ("retry", "timeout") if key in spec}
        usable = re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,63}", name) and not keyword.iskeyword(name) and name != "START"
        steps[name if usable else f"step{index}"] = {
            "agent": "support", **options
        }
    suffix = f"_{_RUN_MARK}{next(_written)}"
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




def _workflow_exists(name) -> bool:
    """A workflow a run may start now: stored, and every workflow it runs stored too."""
    if not isinstance(name, str):
        return False
    try:
        return agent_services.workflow_snapshot(name) is not None
    except WorkflowGraphError:
        return False


def runnable_now(case) -> None:
    """A run's `agent` or `workflow` made one that exists now.

    The schema names the workflows there were when it was loaded; the superuser's fuzzing deletes
    some of them (the seeded one too) while the run goes on, and a start naming one is then
    refused, rightly. Either field may name it (`workflow` is only ever a workflow). The case keeps
    a name of the schema's choice that still exists, else it runs the agent `support`.
    """
    body = case.body
    if isinstance(body.get("agent"), str) and body["agent"] not in AGENTS and not _workflow_exists(body["agent"]):
        body["agent"] = "support"
    if isinstance(body.get("workflow"), str) and not _workflow_exists(body["workflow"]):
        others = WorkflowDefinition.objects.order_by("name").values_list("name", flat=True)
        name = next((name for name in others if _valid(case.operation, {**body, "workflow": name})), None)
        if name is not None:
            body["workflow"] = name
        else:
            del body["workflow"]
            body["agent"] = "support"


def prepare(case) -> None:
    """Valid requests about runs that exist (so their answers, not only 404s, are checked), and
    workflow bodies valid in what their schema cannot say."""
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return
    if "run_id" in (case.path_parameters or {}):
        case.path_parameters["run_id"] = str(SEEDED_RUN_IDS[len(repr(case.body)) % len(SEEDED_RUN_IDS)])
    if case.path == "/api/runs/" and isinstance(case.body, dict):
        runnable_now(case)
    if (
        case.path in ("/api/workflows/", "/api/workflows/{name}/")
        and case.method.upper() in ("POST", "PUT")
        and isinstance(case.body, dict)
        and _valid(case.operation, case.body)
    ):
        workflow_made_valid(case)


def seed() -> list[uuid.UUID]:
    """Runs and a workflow for the responses to show: nobody started them, forced or cancelled them.

    Idempotent: a database seeded before keeps its runs."""
    if AgentRun.objects.filter(run_id__in=SEEDED_RUN_IDS).count() == len(SEEDED_RUN_IDS):
        return SEEDED_RUN_IDS
    AgentRun.objects.filter(run_id__in=SEEDED_RUN_IDS).delete()
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
    if agent_services.workflow_snapshot("seeded_review") is None:
        agent_services.save_workflow(name="seeded_review", graph=DEMO_WORKFLOW["graph"], description="Seeded.")
    return SEEDED_RUN_IDS
