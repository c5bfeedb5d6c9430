"""What a failed run tells API users: the outcome in words, never the code's exception or the host.

The admin keeps the stored message whole for the desk; the API and the chat stream say what
happened without the exception's class and text, and without the worker's host and pid.
"""

from __future__ import annotations

from datetime import datetime

import pytest
from django.utils import timezone

from agents.models import AdkEvent
from runs.chat.turns import outcome_payload
from runs.ledger import reconcile
from runs.models.ledger import RunStatus, RunStep
from tests.factories import make_run
from tests.helpers import run_now, script_params
from tests.kit import api, login

pytestmark = pytest.mark.django_db

WORKER = "vm-7f3a:48213"


def test_a_tool_exception_stays_on_the_desk(bob, run_viewer):
    run = make_run(created_by=bob, error_code="tool_failed", worker=WORKER,
                   error_message="A tool failed: ScriptedToolError: the CRM at 10.0.0.7 refused the login")
    body = api(bob).get(f"/api/runs/{run.run_id}/")
    text = body.content.decode()
    assert body.status_code == 200
    for internal in ("ScriptedToolError", "10.0.0.7", WORKER):
        assert internal not in text, internal
    assert body.json()["error_message"].startswith("A tool failed")
    assert body.json()["worker"] == ""
    listed = api(bob).get("/api/runs/").content.decode()
    assert "ScriptedToolError" not in listed and WORKER not in listed

    desk = login(run_viewer)
    run_viewer.user_permissions.add(*bob.user_permissions.all())
    page = desk.get(f"/admin/runs/agentrun/{run.pk}/change/").content.decode()
    assert "ScriptedToolError" in page  # the desk reads the whole story
    assert api(run_viewer).get(f"/api/runs/{run.run_id}/").json()["worker"] == WORKER


def test_a_reconciled_run_does_not_name_its_workers_host(bob):
    run = make_run(created_by=bob, status=RunStatus.RUNNING, worker=WORKER, heartbeat_at=timezone.now())
    run.error_message = reconcile.reconciled_message(run, now=timezone.now())
    assert WORKER in run.error_message  # stored for the desk
    type(run).objects.filter(pk=run.pk).update(status=RunStatus.ERROR, error_code="reconciled",
                                               error_message=run.error_message)
    body = api(bob).get(f"/api/runs/{run.run_id}/").json()
    assert WORKER not in body["error_message"]
    assert "No completion was recorded for this run" in body["error_message"]


def test_an_agent_exception_is_not_in_the_chat_outcome(bob):
    run = make_run(created_by=bob, error_code="agent_error", worker=WORKER,
                   error_message="KeyError: 'GOOGLE_API_KEY' in /srv/ledger/agents/billing/agent.py")
    payload = outcome_payload(run)
    assert "KeyError" not in payload["error_message"] and "/srv/ledger" not in payload["error_message"]


def test_a_workflow_steps_exception_stays_on_the_desk(bob):
    run = make_run(created_by=bob)
    RunStep.objects.create(run=run, seq=1, node_path="a", step_name="a", kind="agent", target="support",
                           status="error", error="ScriptedToolError: the CRM is down")
    steps = api(bob).get(f"/api/runs/{run.run_id}/").json()["steps"]
    assert steps and "ScriptedToolError" not in steps[0]["error"]


@pytest.mark.django_db(transaction=True)
def test_an_events_error_reads_as_the_run_pages_words_not_the_exception(bob):
    run = run_now(params=script_params({"say": "Hello."}), created_by=bob, owner_id="bob")
    AdkEvent.objects.create(
        id="boom-1", app_name=run.agent_name, user_id=run.owner_id, session_id=run.session_id,
        invocation_id=run.invocation_id, timestamp=datetime(2100, 1, 1),
        event_data={"author": "support", "error_code": "RuntimeError",
                    "error_message": "Error in plugin 'effects': secret internal boom"},
    )
    body = api(bob).get(f"/api/runs/{run.run_id}/events/")
    assert body.status_code == 200
    text = body.content.decode()
    assert "RuntimeError" not in text and "secret internal boom" not in text
    (failed,) = [event for event in body.json()["events"] if event["error_code"]]
    assert failed["error_code"] == "agent_error" and "support can read the error" in failed["error_message"]
