"""Call ids of the scripted model never collide, and the journal never loses a call whose id does."""

from __future__ import annotations

import re

import pytest
from django.core.exceptions import ValidationError
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from agents.models import OutboxEmail
from agents.scripted import ScriptError, validate_script
from runs.execution import executor
from runs.models.ledger import AgentRun, RunStatus
from runs.services import run as services
from tests.helpers import EMAIL_ARGS, LOOKUP, SAY_DONE, SEND_EMAIL, package_source, run_now, script_params

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed


def test_a_script_whose_explicit_ids_repeat_is_refused_naming_the_steps():
    script = [{**LOOKUP, "id": "c1"}, SAY_DONE, [{**SEND_EMAIL, "id": "c2"}, {**LOOKUP, "id": "c1"}]]

    with pytest.raises(ScriptError) as refused:
        validate_script(script)

    assert str(refused.value) == "Each call id must be unique in a run: step 1, step 3 use the id 'c1'."


def test_distinct_explicit_ids_and_calls_without_ids_are_accepted():
    script = [{**LOOKUP, "id": "c1"}, [{**SEND_EMAIL, "id": "c2"}, LOOKUP], LOOKUP, SAY_DONE]

    assert validate_script(script) == script


def test_an_explicit_id_longer_than_the_journal_keeps_is_refused():
    with pytest.raises(ScriptError, match="Step 1: \"id\" is longer than 128 characters"):
        validate_script([{**LOOKUP, "id": "c" * 129}])


def test_the_api_refuses_repeated_ids_with_a_400_naming_the_steps(no_worker, alice):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=alice).key}")
    params = script_params({**LOOKUP, "id": "same"}, {**SEND_EMAIL, "id": "same"}, SAY_DONE)

    response = client.post(
        "/api/runs/", {"agent": "support", "message": "hi", "owner_id": "jane", "params": params}, format="json"
    )

    assert response.status_code == 400, response.content
    body = response.json()
    assert body["code"] == "invalid"
    assert body["errors"]["params"] == [
        "params.script: Each call id must be unique in a run: step 1, step 2 use the id 'same'."
    ]
    assert not AgentRun.objects.exists()


def test_ids_repeated_across_the_scripts_of_one_run_are_refused(agents_dir):
    agents_dir(mailer=package_source("mailer"))
    params = {
        "script": [{**LOOKUP, "id": "shared"}, {"call": "transfer_to_agent", "args": {"agent_name": "notes"}}],
        "scripts": {"notes": [{**LOOKUP, "id": "shared"}, SAY_DONE]},
    }

    with pytest.raises(ValidationError) as refused:
        services.start_run(agent_name="mailer", message="hi", owner_id="jane", params=params, enqueue=False)

    assert refused.value.message_dict["params"] == [
        "Each call id must be unique in a run: params.script: step 1, params.scripts.notes: step 1 use the id 'shared'."
    ]


@committed
def test_generated_call_ids_are_full_uuid4s():
    run = run_now(params=script_params(LOOKUP, [LOOKUP, LOOKUP], LOOKUP, SAY_DONE))

    ids = list(run.tool_calls.values_list("call_id", flat=True))
    assert len(ids) == 4 and len(set(ids)) == 4
    assert all(re.fullmatch(r"call-[0-9a-f]{32}", call_id) for call_id in ids), ids


@committed
def test_a_call_reusing_an_id_is_refused_before_its_tool_runs_never_dropped_from_the_journal():
    # A run resumed in its ADK session, or a script stored before ids were checked, can still
    # reuse an id: the journal is the last line. Before, the second call's row was dropped
    # (ON CONFLICT DO NOTHING) while its tool ran: the email went out and the ledger said only
    # lookup_customer, so a replay would have sent it again.
    run = services.start_run(agent_name="support", message="hi", owner_id="jane",
                             params=script_params(LOOKUP, SAY_DONE), enqueue=False)
    colliding = [{**LOOKUP, "id": "c1"}, {**SEND_EMAIL, "id": "c1"}, SAY_DONE]
    AgentRun.objects.filter(pk=run.pk).update(config={**run.config, "params": {"script": colliding}})

    executor.execute(run.run_id)
    run.refresh_from_db()

    assert not OutboxEmail.objects.filter(to=EMAIL_ARGS["to"]).exists()
    assert run.status == RunStatus.ERROR
    assert run.error_code == "duplicate_call_id"
    assert "'c1'" in run.error_message and "send_email" in run.error_message
    # What the ledger says is what ran: the lookup, and nothing else.
    assert list(run.tool_calls.values_list("call_id", "tool_name")) == [("c1", "lookup_customer")]
    assert run.tools_executed == ["lookup_customer"]
