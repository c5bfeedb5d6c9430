"""Resume instead of replay: a failed run continued in its own session (docs/architecture.md, "Resume rules").

In-process tests stop a run at the second model call (the model raises, as a dead provider
would); the crash cases, where a worker process is SIGKILLed at a point, are in
`tests/test_resume_crash.py` on PostgreSQL.
"""

from __future__ import annotations

import pytest

from agents import scripted
from agents.models import CrmNote, OutboxEmail
from agents.scripted import ScriptedLlm
from runs import executor, resume
from runs.models import AgentRun, RunStatus
from tests.helpers import SAY_DONE, SEND_EMAIL, UPDATE_CRM, run_now, script_params

db = pytest.mark.django_db(transaction=True)
SCRIPT = [SEND_EMAIL, UPDATE_CRM, {"say": "Emailed Jane and noted it."}]


@pytest.fixture
def model_down_at_second_call(monkeypatch):
    """The model provider fails at the run's second model call; `restore()` brings it back."""
    original = ScriptedLlm.generate_content_async

    async def down(self, llm_request, stream=False):
        if self.calls_made >= 1:
            raise scripted.ScriptedModelError("The provider is down.")
        async for response in original(self, llm_request, stream):
            yield response

    monkeypatch.setattr(ScriptedLlm, "generate_content_async", down)
    return lambda: monkeypatch.setattr(ScriptedLlm, "generate_content_async", original)


def execute(run: AgentRun) -> AgentRun:
    executor.execute(run.run_id)
    run.refresh_from_db()
    return run


@db
def test_a_run_stopped_after_send_email_resumes_with_update_crm_only(alice, model_down_at_second_call):
    original = run_now(params=script_params(*SCRIPT), created_by=alice)
    assert (original.status, original.tools_executed) == (RunStatus.ERROR, ["send_email"])
    model_down_at_second_call()
    requests = []
    scripted.request_observers.append(requests.append)
    try:
        resumed = execute(resume.resume_run(original.run_id, actor=alice))
    finally:
        scripted.request_observers.remove(requests.append)
    assert resumed.status == RunStatus.SUCCESS, resumed.error_message
    assert resumed.tools_executed == ["update_crm"]
    assert resumed.session_id == original.session_id and resumed.resume_of_id == original.run_id
    assert OutboxEmail.objects.count() == 1 and CrmNote.objects.count() == 1
    history = [part.function_response.response for content in requests[0].contents for part in content.parts
               if part.function_response]
    assert history and history[0]["status"] == "sent"
    assert resumed.result == "Emailed Jane and noted it."
