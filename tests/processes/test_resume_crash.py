"""Resume after a real crash: a worker process SIGKILLed at a point, then the run continued in its session.

The children and their kill points are the crash matrix's (`tests/processes/test_crash_matrix.py`). The
parent plays the rest of the world (the periodic sweep past the stale window, a person settling
a call from what the outbox shows) and resumes the run in this process.

`test_emails_per_run_after_resume_at_each_point` measures the crash matrix's "resume" column:
`DATABASE_URL=postgres://… pytest tests/processes/test_resume_crash.py -k each_point -s` prints it.
"""

from __future__ import annotations

import json
import os
import textwrap
import threading

import pytest

from agents import scripted
from agents.models import CrmNote, OutboxEmail
from runs.execution.executor import execute as execute_run
from runs.ledger import reconcile
from runs.models.ledger import AgentRun, RunStatus
from runs.refusals import ResumeCallsInDoubt
from runs.rules import resume
from runs.services import decisions
from runs.services import run as services
from tests.helpers import EMAIL_ARGS, UPDATE_CRM, postgres_only, run_python
from tests.processes.test_crash_matrix import POINTS, _crash_child, _past_the_stale_window

# A worker process killed with SIGKILL must see the test's rows, and the test its commits.
pytestmark = [pytest.mark.slow, postgres_only, pytest.mark.django_db(transaction=True)]

SEND_EMAIL = {"call": "send_email", "args": EMAIL_ARGS}
ANSWER = {"say": "Emailed Jane and noted it in the CRM."}
AFTER_THE_ANSWER = 6  # the crash matrix's point: the tool's response stored, the next model call not made


def crashed(point: int, script: list) -> AgentRun:
    run = _crash_child(point, "support", script=script)
    reconcile.sweep(now=_past_the_stale_window())
    run.refresh_from_db()
    return run


def resumed_and_executed(run: AgentRun, actor) -> AgentRun:
    again = services.resume_run(run.run_id, actor=actor)
    execute_run(str(again.run_id))
    again.refresh_from_db()
    return again


def test_killed_after_send_email_answered_resumes_with_update_crm_once(admin_user):
    run = crashed(AFTER_THE_ANSWER, [SEND_EMAIL, UPDATE_CRM, ANSWER])
    assert (run.status, run.error_code, run.tools_executed) == (RunStatus.ERROR, "reconciled", ["send_email"])
    assert OutboxEmail.objects.count() == 1

    requests = []
    scripted.request_observers.append(requests.append)
    try:
        again = resumed_and_executed(run, admin_user)
    finally:
        scripted.request_observers.remove(requests.append)

    assert again.status == RunStatus.SUCCESS, again.error_message
    assert again.tools_executed == ["update_crm"] and again.result == ANSWER["say"]
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 1
    recorded = [part.function_response for content in requests[0].contents for part in content.parts
                if part.function_response]
    assert [(r.name, r.response["status"]) for r in recorded] == [("send_email", "sent")]
    assert list(again.tool_calls.values_list("tool_name", "status")) == [("update_crm", "answered")]


def test_killed_inside_send_email_after_its_effect_waits_for_a_person_then_reuses_the_record(admin_user):
    run = crashed(5, [dict(SEND_EMAIL, crash="after_effect"), UPDATE_CRM, ANSWER])
    assert OutboxEmail.objects.count() == 1
    with pytest.raises(ResumeCallsInDoubt) as refused:
        services.resume_run(run.run_id, actor=admin_user)
    call = run.tool_calls.get(tool_name="send_email")
    assert refused.value.context["calls"] == [call.call_id]

    decisions.settle_call(run_id=run.run_id, call_id=call.call_id, actor=admin_user, outcome="done",
                        note="The outbox shows one email to Jane.")
    again = resumed_and_executed(run, admin_user)
    assert again.status == RunStatus.SUCCESS, again.error_message
    assert again.tools_executed == ["update_crm"]
    assert OutboxEmail.objects.count() == 1, "a settled call was done again"


def test_killed_inside_send_email_before_its_effect_settled_not_done_is_sent_once(admin_user):
    run = crashed(4, [dict(SEND_EMAIL, crash="before_effect"), UPDATE_CRM, ANSWER])
    assert OutboxEmail.objects.count() == 0
    call = run.tool_calls.get(tool_name="send_email")
    decisions.settle_call(run_id=run.run_id, call_id=call.call_id, actor=admin_user, outcome="not_done",
                        note="The outbox holds nothing from this run.")
    again = resumed_and_executed(run, admin_user)
    assert again.status == RunStatus.SUCCESS, again.error_message
    # The model is told the email did not happen and calls it again; then it goes on.
    assert again.tools_executed == ["send_email", "update_crm"]
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 1


def test_two_processes_resuming_one_run_create_one_resume(admin_user):
    run = crashed(AFTER_THE_ANSWER, [SEND_EMAIL, UPDATE_CRM, ANSWER])
    code = textwrap.dedent(f"""
        from django.contrib.auth import get_user_model
        from config.lib.refusals import Refusal
        from runs.services import run as services
        actor = get_user_model().objects.get(pk={admin_user.pk})
        try:
            print(services.resume_run("{run.run_id}", actor=actor).run_id)
        except Refusal as refusal:
            print(refusal.code)
    """)
    results: list[str] = []

    def child() -> None:
        finished = run_python(code)
        assert finished.returncode == 0, finished.stderr[-2000:]
        results.append(finished.stdout.split()[-1])

    threads = [threading.Thread(target=child) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    resumes = list(AgentRun.objects.filter(resume_of=run).values_list("run_id", flat=True))
    assert len(resumes) == 1
    assert sorted(results) == sorted([str(resumes[0]), "already_resumed"])


@pytest.mark.parametrize("point", sorted(POINTS))
def test_emails_per_run_after_resume_at_each_point(point, admin_user, request):
    """The crash matrix's resume column: after the kill, the sweep and the redelivery, a resume (a person
    settling a call in doubt from what the outbox shows) finishes the run with one email in total."""
    run = _crash_child(point, "support", script=[
        {**SEND_EMAIL, **{k: v for k, v in POINTS[point]["script"][0].items() if k == "crash"}}, ANSWER])
    reconcile.sweep(now=_past_the_stale_window())
    execute_run(str(run.run_id))  # the redelivered task
    run.refresh_from_db()
    steps = []
    decision = resume.decide_resume(run)
    if isinstance(decision.refusal, ResumeCallsInDoubt):
        emails = OutboxEmail.objects.filter(run_id=run.run_id).count()
        outcome = "done" if emails else "not_done"
        for call_id in decision.refusal.context["calls"]:
            decisions.settle_call(run_id=run.run_id, call_id=call_id, actor=admin_user, outcome=outcome,
                                note=f"The outbox shows {emails} email(s) from this run.")
        steps.append(f"settled {outcome}")
        decision = resume.decide_resume(run)
    if decision.allowed:
        again = resumed_and_executed(run, admin_user)
        steps.append(f"resumed: {again.status}, tools {again.tools_executed}")
        assert again.status == RunStatus.SUCCESS, again.error_message
        if point == 7:
            # It had answered before the kill: that answer is the resume's result.
            assert again.result == ANSWER["say"]
    else:
        steps.append(f"not resumed: {decision.code}")
        assert (point, decision.code) == (1, "run_succeeded"), decision.as_dict()
    total = OutboxEmail.objects.count()
    assert total == 1, f"point {point}: {steps}"
    line = f"resume column, point {point} ({POINTS[point]['label']}): {' → '.join(steps)}; emails {total}"
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(line)
    output = os.environ.get("RESUME_COLUMN_OUTPUT")
    if output:
        with open(output, "a") as handle:
            handle.write(json.dumps({"point": point, "steps": steps, "emails": total}) + "\n")
