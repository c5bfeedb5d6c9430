"""The OpenAPI schema states what the API does: the fields it answers null, the inputs it refuses."""

from __future__ import annotations

import jsonschema_rs
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from drf_spectacular.generators import SchemaGenerator

from config.lib.serializers import SOME_WORD
from runs.models.ledger import AgentRun, ToolCall
from tests.factories import make_run, with_journal
from tests.kit import api_as, refused

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_worker")]



@pytest.fixture
def api(django_user_model):
    return api_as(django_user_model.objects.create_superuser("root", password="root-pass-123"))


@pytest.fixture
def schema():
    return SchemaGenerator().get_schema(request=None, public=True)


# --- Who did it: null when nobody did ---------------------------------------------------------------


def test_user_fields_answer_null_when_nobody_and_the_schema_says_they_may(api, schema):
    run = with_journal(make_run(created_by=None), [("send_email", "idempotent", "called")])

    body = api.get(f"/api/runs/{run.run_id}/").json()

    assert (body["created_by"], body["forced_by"], body["cancel_requested_by"]) == (None, None, None)
    assert body["tool_calls"][0]["settled_by"] is None
    assert body["tool_calls"][0]["settled_outcome"] == ""
    components = schema["components"]["schemas"]
    for field in ("created_by", "forced_by", "cancel_requested_by"):
        assert components["Run"]["properties"][field]["nullable"] is True
        assert components["RunDetail"]["properties"][field]["nullable"] is True
    assert components["ToolCall"]["properties"]["settled_by"]["nullable"] is True
    assert components["Workflow"]["properties"]["updated_by"]["nullable"] is True


# --- Empty names are refused, and the schema says so ------------------------------------------------


@pytest.mark.parametrize(
    ("query", "code", "sentence"),
    [
        ("agent=&owner_id=alice&q=refund", "missing_scope", "agent is required"),
        ("agent=support&owner_id=&q=refund", "missing_scope", "owner_id is required"),
        ("agent=support&owner_id=%20&q=refund", "missing_scope", "owner_id is required"),
        ("agent=support&owner_id=alice&q=", "empty_query", "q is required"),
    ],
)
def test_an_empty_memory_scope_or_query_is_a_400_naming_it(api, query, code, sentence):
    body = refused(api.get(f"/api/memory/?{query}"), 400, code)

    assert body["detail"].startswith(sentence)


def test_the_memory_search_parameters_are_stated_as_they_are_read(schema):
    parameters = {p["name"]: p for p in schema["paths"]["/api/memory/"]["get"]["parameters"]}

    assert {"support", "triage", "billing"} <= set(parameters["agent"]["schema"]["enum"])
    assert parameters["owner_id"]["schema"] == {"type": "string", "minLength": 1, "maxLength": 128,
                                                "format": "printable"}
    assert parameters["q"]["schema"]["format"] == "search-words"
    assert parameters["limit"]["schema"] == {"type": "integer", "minimum": 1, "maximum": 100}
    assert all(parameters[name]["required"] for name in ("agent", "owner_id", "q"))


@pytest.mark.parametrize(("query", "searched"), [
    ("refund", True), ("Ô", True), ("naïve café", True), ("日本語", True), ("١٢٣", True),
    ("!!!", False), ("_ - _", False), ("...?", False),
])
def test_the_memory_query_pattern_as_json_schema_reads_it_admits_every_query_the_api_searches(
    api, schema, query, searched
):
    # JSON Schema's patterns are ECMA-262's, whose \w is ASCII only (jsonschema_rs, which
    # schemathesis validates with, reads them so); the API's words are any script's.
    parameters = {p["name"]: p for p in schema["paths"]["/api/memory/"]["get"]["parameters"]}
    pattern = jsonschema_rs.validator_for(parameters["q"]["schema"])

    response = api.get("/api/memory/", {"agent": "support", "owner_id": "alice", "q": query})

    assert response.status_code == (200 if searched else 400), response.content[:300]
    if searched:
        assert pattern.is_valid(query)
    else:
        # No letter or digit in any script: refused by the pattern itself, not only by the format.
        assert not pattern.is_valid(query)


# Where Python's whitespace (what strip() removes) and ECMA-262's \s, JSON Schema's, disagree.
SPACE_IN_ONE_READING = ["\x1c", "\x1d", "\x1e", "\x1f", "\x85", "\ufeff"]


@pytest.mark.parametrize("text", [*SPACE_IN_ONE_READING, " ", "\u3000", "\xa0 \t", "x", " \ufeff x"])
def test_a_blank_message_or_reason_is_blank_as_json_schema_reads_the_schema_too(api, schema, settings, text):
    # jsonschema_rs reads patterns as ECMA-262, as JSON Schema says (and as schemathesis checks them).
    settings.SCRIPTED_DEFAULT_SCRIPTS = True
    components = schema["components"]["schemas"]
    message = jsonschema_rs.validator_for(components["RunCreateRequest"]["properties"]["message"])
    forced = jsonschema_rs.validator_for(components["ReplayRequestRequest"]["oneOf"][1]["properties"]["reason"])
    blank = not text.strip()

    response = api.post("/api/runs/", {"agent": "support", "message": text, "owner_id": "jane"}, format="json")

    assert response.status_code == (400 if blank else 202), response.content[:300]
    assert message.is_valid(text) is not blank
    assert forced.is_valid(text) is not blank


@pytest.mark.parametrize(
    ("field", "body"),
    [
        ("agent", {"agent": "", "message": "hi", "owner_id": "jane"}),
        ("owner_id", {"agent": "support", "message": "hi", "owner_id": ""}),
        ("owner_id", {"agent": "support", "message": "hi", "owner_id": "   "}),
        ("message", {"agent": "support", "message": " ", "owner_id": "jane"}),
    ],
)
def test_an_empty_agent_owner_or_message_is_a_400_naming_it(api, field, body):
    answer = refused(api.post("/api/runs/", body, format="json"), 400, "invalid")

    assert list(answer["errors"]) == [field]
    assert not AgentRun.objects.exists()


def test_the_run_start_body_is_stated_as_it_is_read(settings):
    settings.SCRIPTS_FROM_USERS_ALLOWED = False
    components = SchemaGenerator().get_schema(request=None, public=True)["components"]["schemas"]
    create, upload = components["RunCreateRequest"], components["RunUploadRequest"]

    assert create["additionalProperties"] is False and upload["additionalProperties"] is False
    assert create["oneOf"] == [{"required": ["agent"]}, {"required": ["workflow"]}]
    assert create["properties"]["owner_id"]["minLength"] == 1
    assert create["properties"]["owner_id"]["format"] == "printable"
    assert "oneOf" not in create["properties"]["message"]  # no "or an empty string"
    assert "file" not in create["properties"] and "workflow" not in upload["properties"]
    assert "agent" in upload["required"]
    # Without scripts from users, params says it takes none; with them, any object.
    assert create["properties"]["params"]["not"] == {"anyOf": [{"required": ["script"]}, {"required": ["scripts"]}]}
    settings.SCRIPTS_FROM_USERS_ALLOWED = True
    create = SchemaGenerator().get_schema(request=None, public=True)["components"]["schemas"]["RunCreateRequest"]
    assert "not" not in create["properties"]["params"]


def test_a_multipart_start_names_the_workflow_as_agent_and_json_cannot_carry_a_file(api):
    upload = SimpleUploadedFile("note.txt", b"hello")
    body = refused(api.post("/api/runs/", {"workflow": "refund_review", "message": "hi", "owner_id": "jane",
                                           "file": upload}, format="multipart"), 400, "invalid")
    assert "workflow" in body["errors"]

    body = refused(api.post("/api/runs/", {"agent": "support", "message": "hi", "owner_id": "jane", "file": "x"},
                            format="json"), 400, "invalid")
    assert list(body["errors"]) == ["file"]


# --- Query parameters typed and bounded ----------------------------------------------------------------


@pytest.mark.parametrize("page_size", ["null", "0", "201", "1.5", "-3", "٣"])
def test_a_page_size_the_api_cannot_honour_is_a_400_naming_it(api, page_size):
    body = refused(api.get("/api/runs/", {"page_size": page_size}), 400, "invalid")

    assert list(body["errors"]) == ["page_size"]


def test_a_page_size_in_range_is_honoured_and_stated(api, schema):
    for _ in range(3):
        make_run()

    assert len(api.get("/api/runs/", {"page_size": 2}).json()["results"]) == 2
    parameters = {p["name"]: p for p in schema["paths"]["/api/runs/"]["get"]["parameters"]}
    assert parameters["page_size"]["schema"] == {"type": "integer", "minimum": 1, "maximum": 200}


# --- Bodies and errors -------------------------------------------------------------------------------


def test_a_replay_body_is_plain_or_forced_with_a_reason(schema):
    replay = schema["components"]["schemas"]["ReplayRequestRequest"]

    plain, forced = replay["oneOf"]
    assert plain["properties"]["effects"] == {"allOf": [{"enum": ["reuse"]}]}
    assert forced["required"] == ["force", "reason"]
    assert forced["properties"]["reason"] == {"pattern": SOME_WORD}


def test_every_operation_declares_the_errors_it_answers(schema):
    declared = {
        (path, method): set(operation["responses"])
        for path, methods in schema["paths"].items()
        for method, operation in methods.items()
    }

    assert {"400", "401", "403", "413", "415", "429"} <= declared[("/api/runs/", "post")]
    assert {"400", "401", "403", "404", "409", "410", "429"} <= declared[("/api/runs/{run_id}/replay/", "post")]
    assert {"400", "401", "404"} <= declared[("/api/memory/", "get")]
    for (path, _method), statuses in declared.items():
        if not path.startswith("/api/webhooks/"):  # a provider signs; it has no user to authenticate
            assert "401" in statuses, path


def test_the_chat_turn_is_a_stream_in_the_schema(schema):
    chat = schema["paths"]["/api/chat/"]["post"]

    assert list(chat["responses"]["200"]["content"]) == ["text/event-stream"]
    assert {"400", "401", "404", "409", "413", "429"} <= set(chat["responses"])


def test_an_unsettled_calls_outcome_is_empty_and_stated(schema):
    outcome = schema["components"]["schemas"]["ToolCall"]["properties"]["settled_outcome"]

    assert ToolCall._meta.get_field("settled_outcome").blank
    assert outcome["oneOf"][1] == {"$ref": "#/components/schemas/BlankEnum"}


def test_the_agents_and_workflows_a_run_may_name_are_those_that_exist_now():
    from agents import services as agent_services
    from agents.demo import DEMO_WORKFLOW

    def enums() -> dict[str, list]:
        components = SchemaGenerator().get_schema(request=None, public=True)["components"]["schemas"]
        found = {}
        for name, prop in components["RunCreateRequest"]["properties"].items():
            for part in [prop, *prop.get("allOf", [])]:
                if "$ref" in part:
                    part = components[part["$ref"].rsplit("/", 1)[-1]]
                if "enum" in part:
                    found[name] = part["enum"]
        return found

    assert "workflow" not in enums()  # no workflow yet: none can be named
    agent_services.save_workflow(name="refund_review", graph=DEMO_WORKFLOW["graph"])

    assert enums()["workflow"] == ["refund_review"]
    assert {"support", "refund_review"} <= set(enums()["agent"])


def test_every_throttled_operation_documents_its_429(schema):
    paths = schema["paths"]
    for path, method in [("/api/runs/", "post"), ("/api/runs/{run_id}/replay/", "post"),
                         ("/api/runs/{run_id}/resume/", "post")]:
        assert "429" in paths[path][method]["responses"], (path, method)
