"""Who may answer a call that waits, and whether a run goes on for its owner (runs.rules.owners, runs.rules.permissions).

A decision asks the owner rule as a result does; the run's starter is not the second person a
confirmation stands for; a grant taken back stops a run that goes on (after it waited, or continued by
the system); approvers see the runs that wait for them, of the owners they may act for.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from google.adk.utils._function_call_names import REQUEST_CONFIRMATION_FUNCTION_CALL_NAME
from google.genai import types

from agents.models import Refund
from runs.adkwire.turns import answer_waiting
from runs.execution import executor
from runs.ledger import lifecycle, reconcile
from runs.models.approvals import PendingCall
from runs.models.ledger import AgentRun, RunStatus
from runs.models.owners import OwnerGrant
from runs.refusals import ApprovalByStarter
from runs.rules import visibility
from runs.rules.faults import faults_honoured
from runs.rules.quotas import TooManyRunsInFlight
from runs.services import run as services
from runs.upkeep import recovery
from tests.helpers import run_now, script_params
from tests.kit import api, login
from tests.services.test_approvals import BIG_REFUND, REFUNDED, approver  # noqa: F401 - fixture

db = pytest.mark.django_db(transaction=True)


def _user(django_user_model, name: str, *codenames: str, staff: bool = False):
    user = django_user_model.objects.create_user(name, password=f"{name}-pass-123", is_staff=staff)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    return user


def _waiting(*, created_by, owner_id: str = "alice") -> tuple[AgentRun, PendingCall]:
    run = run_now(params=script_params(BIG_REFUND, REFUNDED), created_by=created_by, owner_id=owner_id)
    assert run.status == RunStatus.WAITING, (run.error_code, run.error_message)
    return run, PendingCall.objects.get(run=run)


def _decide(user, run, pending, decision: str = "approve"):
    return api(user).post(f"/api/runs/{run.run_id}/calls/{pending.call_id}/decision/", {"decision": decision},
                          format="json")


def _admin_decide(user, run, pending) -> list[str]:
    client = login(user)
    response = client.post(f"/admin/runs/agentrun/{run.run_id}/calls/{pending.call_id}/answer/",
                           {"decision": "approve"}, follow=True)
    return [str(message) for message in response.context["messages"]] if response.context else []


# --- A decision asks the owner rule ---------------------------------------------------------------------


@db
def test_a_decision_asks_the_owner_rule_as_a_result_does(alice, django_user_model):
    outsider = _user(django_user_model, "otto", "approve_toolcall", "view_agentrun", "answer_toolcall", staff=True)
    run, pending = _waiting(created_by=alice)
    refused = _decide(outsider, run, pending)
    assert refused.status_code == 403 and refused.json()["code"] == "owner_not_permitted", refused.json()
    said = _admin_decide(outsider, run, pending)
    assert any("may not act for owner 'alice'" in message for message in said), said
    pending.refresh_from_db()
    run.refresh_from_db()
    assert pending.decision == "" and run.status == RunStatus.WAITING and Refund.objects.count() == 0


# --- The starter is not the second person ------------------------------------------------------------------


@db
def test_the_starter_may_not_approve_their_own_run_unless_the_setting_allows(approver, settings):  # noqa: F811
    run, pending = _waiting(created_by=approver, owner_id="ada")
    refused = _decide(approver, run, pending)
    assert refused.status_code == 403 and refused.json()["code"] == "approval_by_starter", refused.json()
    said = _admin_decide(approver, run, pending)
    assert any("You started run" in message for message in said), said
    pending.refresh_from_db()
    assert pending.decision == "" and Refund.objects.count() == 0

    settings.APPROVAL_BY_STARTER_ALLOWED = True
    assert _decide(approver, run, pending).status_code == 202


# --- A grant taken back stops the run going on ----------------------------------------------------------------


@db
def test_a_run_answered_after_its_starters_grant_was_taken_back_ends_refused_and_does_nothing(bob, approver,  # noqa: F811
                                                                                              admin_user):
    grant = OwnerGrant.objects.create(user=bob, owner_id="carol", granted_by=admin_user)
    run, pending = _waiting(created_by=bob, owner_id="carol")
    grant.delete()
    assert _decide(approver, run, pending).status_code == 202
    executor.execute(run.run_id)
    run.refresh_from_db()
    assert (run.status, run.error_code) == (RunStatus.ERROR, "owner_not_permitted")
    assert "may no longer act for owner 'carol'" in run.error_message
    pending.refresh_from_db()
    assert Refund.objects.count() == 0 and pending.delivered_attempt is None


def _died_before_writing(*, created_by, owner_id: str) -> AgentRun:
    run = services.start_run(agent_name="support", message="Look Jane up.", owner_id=owner_id, created_by=created_by,
                             params=script_params({"say": "Found her."}), enqueue=False)
    assert lifecycle.claim_run(run_id=run.run_id, worker="gone:1")
    reconcile.reconcile_dead_worker(worker="gone:1")
    return run


@db
def test_a_system_continuation_carries_the_chains_person_and_asks_the_owner_rule_again(bob, admin_user, settings):
    grant = OwnerGrant.objects.create(user=bob, owner_id="carol", granted_by=admin_user)
    original = _died_before_writing(created_by=bob, owner_id="carol")
    again = recovery.recover(run_id=original.run_id)
    assert again is not None
    assert (again.created_by, again.continued_by_system, again.replay_of_id) == (bob, True, original.run_id)
    # bob's own: he sees it, it counts in his cap, he may cancel it.
    assert api(bob).get(f"/api/runs/{again.run_id}/").status_code == 200
    settings.MAX_RUNS_IN_FLIGHT_PER_USER = 1
    with pytest.raises(TooManyRunsInFlight):
        services.start_run(agent_name="support", message="More.", owner_id="bob", created_by=bob, enqueue=False)
    assert api(bob).post(f"/api/runs/{again.run_id}/cancel/").status_code in (200, 202)

    # The grant taken back: the system continues nothing more for carol, and a continuation already
    # written ends refused when a worker takes it.
    later = _died_before_writing(created_by=bob, owner_id="carol")
    written = recovery.recover(run_id=later.run_id)
    grant.delete()
    executor.execute(written.run_id)
    written.refresh_from_db()
    assert (written.status, written.error_code) == (RunStatus.ERROR, "owner_not_permitted")
    last = _died_before_writing(created_by=admin_user, owner_id="carol")
    AgentRun.objects.filter(pk=last.pk).update(created_by=bob)
    assert recovery.recover(run_id=last.run_id) is None
    last.refresh_from_db()
    assert last.recovery == "needs_person" and "owner_not_permitted" in last.recovery_detail


@db
def test_faults_in_a_system_continuation_follow_the_chains_person(bob, admin_user, settings):
    OwnerGrant.objects.create(user=bob, owner_id="carol", granted_by=admin_user)
    original = _died_before_writing(created_by=admin_user, owner_id="carol")
    AgentRun.objects.filter(pk=original.pk).update(created_by=bob)
    again = recovery.recover(run_id=original.run_id)
    assert again.created_by == bob and not faults_honoured(again)


# --- Approvers see what waits for them -------------------------------------------------------------------------


@db
def test_an_approver_with_the_permission_and_the_owner_sees_and_answers_its_waiting_runs_only(
        alice, bob, django_user_model, admin_user):
    lead = _user(django_user_model, "lena", "approve_toolcall")
    OwnerGrant.objects.create(user=lead, owner_id="alice", granted_by=admin_user)
    run, pending = _waiting(created_by=alice)
    other, other_pending = _waiting(created_by=alice, owner_id="dora")
    settled = run_now(params=script_params({"say": "Hi."}), created_by=alice)

    assert api(lead).get(f"/api/runs/{run.run_id}/").status_code == 200
    assert api(lead).get(f"/api/runs/{run.run_id}/events/").status_code == 200
    assert api(lead).get(f"/api/runs/{other.run_id}/").status_code == 404
    assert api(lead).get(f"/api/runs/{settled.run_id}/").status_code == 404
    assert set(visibility.visible_runs(lead)) == {run}
    assert _decide(lead, run, pending).status_code == 202
    assert _decide(lead, other, other_pending).status_code == 404

    # Seeing is not acting: no replay, no cancel of the run it may answer.
    assert api(lead).post(f"/api/runs/{run.run_id}/cancel/").status_code == 403


@db
def test_an_integration_answers_one_owners_long_running_calls_without_reading_every_run(
        alice, django_user_model, admin_user):
    LABEL = {"call": "request_return_label", "args": {"order_id": "A-1001"}}
    warehouse = _user(django_user_model, "depot", "answer_toolcall")
    OwnerGrant.objects.create(user=warehouse, owner_id="alice", granted_by=admin_user)
    run = run_now(params=script_params(LABEL, {"say": "Label sent."}), created_by=alice)
    assert run.status == RunStatus.WAITING, run.error_message
    pending = PendingCall.objects.get(run=run)
    answered = api(warehouse).post(f"/api/runs/{run.run_id}/calls/{pending.call_id}/result/",
                                   {"result": {"label_url": "https://carrier.example/l/1"}}, format="json")
    assert answered.status_code == 202, answered.json()
    listed = api(warehouse).get("/api/runs/").json()
    assert [row["run_id"] for row in listed["results"]] == [str(run.run_id)]


@db
def test_the_starter_answering_a_confirmation_over_adks_wire_is_refused_alike(alice):
    alice.user_permissions.add(Permission.objects.get(codename="approve_toolcall"))
    alice = type(alice).objects.get(pk=alice.pk)
    run, pending = _waiting(created_by=alice)
    answer = types.FunctionResponse(id=pending.request_call_id, name=REQUEST_CONFIRMATION_FUNCTION_CALL_NAME,
                                    response={"confirmed": True})
    with pytest.raises(ApprovalByStarter):
        answer_waiting(actor=alice, run=run, responses=[answer])
    pending.refresh_from_db()
    assert pending.decision == "" and Refund.objects.count() == 0
