"""The crash matrix: a worker process is SIGKILLed at each point of a run, for real.

Each repetition starts a child process on the test database that runs an agent — the bundled
`support`, and `mailer`, a package the test writes and loads through AGENTS_DIR — with a one-email
script (`send_email`, then an answer) and dies with SIGKILL at one point — through
the scripted faults where they reach, otherwise through a hook installed in the child that kills
the process at the exact moment. Then the parent plays the rest of the world: the periodic job
(driven directly, past the stale window), the redelivered task, a replay request without force.

For every point and repetition it asserts that the run never executes twice by itself, that it
settles, that `tools_executed` names every call whose effect may have happened (and is never
`[]` when one did), that a replay without force is refused exactly when an effect may have
happened (`calls_in_doubt` while the email's call is unanswered), and that the outbox holds at
most one email per run.

With recovery on (`RUN_RECOVERY=resume`, docs/architecture.md, "Recovery without a person"), every
point ends with exactly one email per run: the system continues by itself what needs nobody, and a
person settles the calls in doubt and resumes; the matrix's columns say which points finished by
themselves and how long after the kill. (The test above runs the sweep without recovery, which is
`RUN_RECOVERY=off`: today's behaviour, every dead run waiting for a person.)

Then the effects (docs/architecture.md, "Effects"): a forced replay with the default choice
(reuse recorded effects) sends exactly one email in total. Where the kill left the email's
effect record `started` (inside the tool, or after it returned but before its response was
stored: the record is done with the response), that replay sends nothing and fails
`effect_in_doubt`; a person settles the call from what the outbox shows, and the next forced
replay either reuses the settled record or sends the email that never went out. Finally a
forced replay that redoes the effects sends a second one.

`CRASH_MATRIX_REPEATS` sets the repetitions per point (1 in the suite, where each point is one
child process killed; `make bench-crash` runs 20 and writes the matrix to
bench/results/crash_matrix.json).
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from collections import Counter, defaultdict
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from agents.models import OutboxEmail
from runs.execution.executor import execute as execute_run
from runs.ledger import reconcile
from runs.models.effects import EffectStatus, ToolEffect
from runs.models.ledger import AgentRun, RunStatus
from runs.rules import replay
from runs.services import decisions
from runs.services import run as services
from runs.upkeep import recovery
from tests.helpers import EMAIL_ARGS, SAY_DONE, package_source, postgres_only, run_python

# A worker process killed with SIGKILL must see the test's rows, and the test its commits.
pytestmark = [pytest.mark.slow, postgres_only, pytest.mark.django_db(transaction=True)]

REPEATS = int(os.environ.get("CRASH_MATRIX_REPEATS", "1"))
SEND_EMAIL = {"call": "send_email", "args": EMAIL_ARGS}

# What the child does before it dies. `KILL` is the SIGKILL every point ends with.
_PRELUDE = """
import json, os, signal
from runs.execution import executor
from runs.ledger import lifecycle
from runs.services import run as services
KILL = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
SCRIPT = json.loads({script!r})
AGENT = {agent!r}
"""
_START_AND_EXECUTE = """
run = services.start_run(agent_name=AGENT, message="Email Jane about her refund.", owner_id="alice",
                         params={"script": SCRIPT}, enqueue=False)
print(run.run_id, flush=True)
executor.execute(run.run_id)
"""

POINTS: dict[int, dict] = {
    1: {
        "label": "after the run row is written, before the claim",
        "script": [SEND_EMAIL, SAY_DONE],
        "hook": """
run = services.start_run(agent_name=AGENT, message="Email Jane about her refund.", owner_id="alice",
                         params={"script": SCRIPT}, enqueue=False)
print(run.run_id, flush=True)
KILL()
""",
        "effect": False,
    },
    2: {
        "label": "after the claim, before the first model call",
        "script": [SEND_EMAIL, SAY_DONE],
        "hook": """
from agents.scripted import ScriptedLlm
async def die(self, llm_request, stream=False):
    KILL()
    yield  # pragma: no cover
ScriptedLlm.generate_content_async = die
""" + _START_AND_EXECUTE,
        "effect": False,
    },
    3: {
        "label": "after a function-call event is stored, before the tool starts",
        "script": [SEND_EMAIL, SAY_DONE],
        "hook": """
from runs.ledger.journal import JournalPlugin
async def die(self, *, tool, tool_args, tool_context):
    KILL()
JournalPlugin.before_tool_callback = die
""" + _START_AND_EXECUTE,
        "effect": False,
    },
    4: {
        "label": "inside the tool, before its effect",
        "script": [dict(SEND_EMAIL, crash="before_effect"), SAY_DONE],
        "hook": _START_AND_EXECUTE,
        "effect": False,
    },
    5: {
        "label": "inside the tool, after its effect",
        "script": [dict(SEND_EMAIL, crash="after_effect"), SAY_DONE],
        "hook": _START_AND_EXECUTE,
        "effect": True,
    },
    6: {
        "label": "after the tool's response is stored, before the next model call",
        "script": [SEND_EMAIL, SAY_DONE],
        "hook": """
from agents.scripted import ScriptedLlm
original = ScriptedLlm.generate_content_async
async def die_on_second_call(self, llm_request, stream=False):
    if self.calls_made >= 1:
        KILL()
    async for response in original(self, llm_request, stream):
        yield response
ScriptedLlm.generate_content_async = die_on_second_call
""" + _START_AND_EXECUTE,
        "effect": True,
    },
    7: {
        "label": "after the final answer, before the run is settled",
        "script": [SEND_EMAIL, SAY_DONE],
        "hook": """
lifecycle.settle_run = KILL
""" + _START_AND_EXECUTE,
        "effect": True,
    },
    8: {
        # The effect record is marked done with the response event, in its transaction: here the
        # tool has acted and returned, and neither is stored, so the call is in doubt.
        "label": "after the tool returned, before its response is stored",
        "script": [SEND_EMAIL, SAY_DONE],
        "hook": """
from agents.session_store import SessionStore
original_append = SessionStore.append_event
async def die_before_a_response(self, session, event):
    if event.get_function_responses():
        KILL()
    return await original_append(self, session, event)
SessionStore.append_event = die_before_a_response
""" + _START_AND_EXECUTE,
        "effect": True,
    },
}

# (agent, point) -> Counter of outcome descriptions, printed at the end of the module.
MATRIX: dict[tuple[str, int], Counter] = defaultdict(Counter)
# point -> (finished by itself, seconds from the kill to success, emails) with recovery on.
RECOVERY_MATRIX: dict[int, list[tuple[bool, float, int]]] = defaultdict(list)
AGENTS = ["support", "mailer"]


@pytest.fixture
def agent(request, agents_dir):
    if request.param != "support":
        agents_dir(**{request.param: package_source(request.param)})
    return request.param


def _crash_child(point: int, agent: str, *, script: list | None = None) -> AgentRun:
    """A child process that runs `agent` and dies at `point` (with the point's script, or `script`)."""
    spec = POINTS[point]
    script = spec["script"] if script is None else script
    code = textwrap.dedent(_PRELUDE.format(script=json.dumps(script), agent=agent)) + textwrap.dedent(spec["hook"])
    child = run_python(code, AGENTS_DIR=",".join(settings.AGENTS_DIR))
    assert child.returncode == -signal.SIGKILL, f"point {point}: the child did not die by SIGKILL\n{child.stderr[-3000:]}"
    run_id = child.stdout.split()[0]
    return AgentRun.objects.get(pk=run_id)


def _past_the_stale_window() -> timezone.datetime:
    return timezone.now() + timedelta(seconds=settings.RUN_STALE_AFTER_SECONDS + 1)


@pytest.mark.parametrize("repetition", range(REPEATS))
@pytest.mark.parametrize("point", sorted(POINTS))
@pytest.mark.parametrize("agent", AGENTS, indirect=True)
def test_a_worker_killed_at_each_point_never_repeats_an_effect(agent, point, repetition, admin_user):
    run = _crash_child(point, agent)
    assert run.agent_name == agent
    effect_happened = OutboxEmail.objects.filter(run_id=run.run_id).exists()
    assert effect_happened == POINTS[point]["effect"], "the kill did not land where the point says"
    attempts_after_crash = run.attempts

    # The world goes on: the periodic job runs (past the stale window), and django-q2 delivers
    # the lost task again.
    reconcile.sweep(now=_past_the_stale_window())
    redelivered = execute_run(str(run.run_id))
    run.refresh_from_db()

    if point == 1:
        # Never claimed, so nothing ran: enqueued again, and the redelivery runs it once.
        assert redelivered == RunStatus.SUCCESS
        assert run.attempts == 1
        assert run.tools_executed == ["send_email"]
    else:
        assert redelivered == "not claimed", "a redelivered task executed the run again"
        assert run.attempts == attempts_after_crash == 1
        assert (run.status, run.error_code) == (RunStatus.ERROR, "reconciled")
        assert "outcome is unknown" in run.error_message
    assert run.status in (RunStatus.SUCCESS, RunStatus.ERROR), "the run did not settle"

    effect_may_have_happened = OutboxEmail.objects.filter(run_id=run.run_id).exists() or point >= 3
    if OutboxEmail.objects.filter(run_id=run.run_id).exists():
        assert run.tools_executed, "an effect happened but tools_executed says none"
    if effect_may_have_happened:
        assert run.tools_executed == ["send_email"]
    else:
        assert run.tools_executed == []

    decision = replay.decide(run, force=False)
    answered = run.tool_calls.filter(status="answered").exists()
    if point == 1:
        assert decision.code == "run_succeeded"
    elif effect_may_have_happened:
        # An unanswered call that acts is in doubt; an answered one is simply called.
        assert decision.code == ("tools_called" if answered else "calls_in_doubt"), decision.as_dict()
    else:
        assert decision.allowed, decision.as_dict()
        # The replay the rules allow does the work exactly once, in a run of its own.
        again = services.replay_run(run.run_id, actor=admin_user)
        assert execute_run(str(again.run_id)) == RunStatus.SUCCESS
        assert OutboxEmail.objects.filter(run_id__in=[run.run_id, again.run_id]).count() == 1
    assert OutboxEmail.objects.filter(run_id=run.run_id).count() <= 1
    original_emails = OutboxEmail.objects.filter(run_id=run.run_id).count()

    # Forced replays with the default choice: reuse recorded effects. Exactly one email in total.
    reuse_steps = []
    for _ in range(2):
        forced = _forced_replay(run, admin_user, effects="reuse")
        reuse_steps.append(f"{forced.status}/{forced.error_code or '-'} emails {_emails(forced)}")
        if forced.status == RunStatus.SUCCESS:
            break
        # Only a call whose effect record says `started` stops a forced replay: killed inside the tool.
        assert point in (4, 5, 8) and forced.error_code == "effect_in_doubt", (forced.error_code, forced.error_message)
        assert ToolEffect.objects.get().status == EffectStatus.STARTED
        assert OutboxEmail.objects.count() == original_emails, "a call in doubt was run again"
        # A person looks at the outbox and says what happened.
        call = run.tool_calls.get(tool_name="send_email")
        outcome = "done" if original_emails else "not_done"
        decisions.settle_call(run_id=run.run_id, call_id=call.call_id, actor=admin_user, outcome=outcome,
                            note=f"The outbox shows {original_emails} email(s) from this run.")
        reuse_steps.append(f"settled {outcome}")
    assert forced.status == RunStatus.SUCCESS, reuse_steps
    assert OutboxEmail.objects.count() == 1, f"point {point}: {reuse_steps}"
    reuse_total = OutboxEmail.objects.count()

    # Forced, redoing the effects: new keys, so the email is sent a second time.
    redone = _forced_replay(run, admin_user, effects="redo")
    assert redone.status == RunStatus.SUCCESS and _emails(redone) == 1
    assert OutboxEmail.objects.count() == 2

    MATRIX[(agent, point)][
        f"{run.status}/{run.error_code or '-'}, tools {run.tools_executed}, "
        f"replay {'allowed' if decision.allowed else decision.code}, emails {original_emails}"
        f" | forced reuse: {' → '.join(reuse_steps)}; total {reuse_total}"
        f" | forced redo: emails {_emails(redone)}; total {OutboxEmail.objects.count()}"
    ] += 1


def _chain(run: AgentRun) -> list[AgentRun]:
    chain = [AgentRun.objects.get(pk=run.pk)]
    while (nxt := AgentRun.objects.filter(resume_of=chain[-1]).first()) is not None:
        chain.append(nxt)
    return chain


@pytest.mark.parametrize("point", sorted(POINTS))
def test_with_recovery_each_point_ends_with_one_email(point, admin_user, settings):
    settings.RUN_RECOVERY = "resume"
    run = _crash_child(point, "support")
    killed = time.monotonic()
    by_itself = True
    for _ in range(settings.RUN_RECOVERY_ATTEMPTS + 2):
        # The world goes on: the sweep with its recovery, and django-q2 delivering what was enqueued.
        reconcile.sweep(now=_past_the_stale_window())
        recovery.recover_due(now=_past_the_stale_window())
        execute_run(str(run.run_id))
        end = _chain(run)[-1]
        if end.status == RunStatus.QUEUED:
            execute_run(str(end.run_id))
            end.refresh_from_db()
        if end.status == RunStatus.SUCCESS:
            break
        # The system left it for a person, for the reason it gives: a call that may have acted.
        assert end.recovery == "needs_person" and "doubt" in end.recovery_detail, (end.error_code, end.recovery_detail)
        by_itself = False
        emails = OutboxEmail.objects.filter(run_id__in=[r.run_id for r in _chain(run)]).count()
        call = end.tool_calls.filter(tool_name="send_email", settled_outcome="").first()
        if call is not None:
            decisions.settle_call(run_id=end.run_id, call_id=call.call_id, actor=admin_user,
                                outcome="done" if emails else "not_done", note=f"The outbox shows {emails} email(s).")
        continued = services.resume_run(end.run_id, actor=admin_user)
        execute_run(str(continued.run_id))
    took = time.monotonic() - killed
    chain = _chain(run)
    assert chain[-1].status == RunStatus.SUCCESS, [(r.status, r.error_code, r.recovery_detail) for r in chain]
    emails = OutboxEmail.objects.filter(run_id__in=[r.run_id for r in chain]).count()
    assert emails == 1, f"point {point}: {emails} emails"
    RECOVERY_MATRIX[point].append((by_itself, took, emails))


def _emails(run: AgentRun) -> int:
    return OutboxEmail.objects.filter(run_id=run.run_id).count()


def _forced_replay(run: AgentRun, actor, *, effects: str) -> AgentRun:
    """Force a replay of `run` and execute it here, with the same email but without the kill."""
    forced = services.replay_run(run.run_id, actor=actor, force=True, reason="crash matrix", effects=effects)
    AgentRun.objects.filter(pk=forced.pk).update(config={**forced.config, "params": {"script": [SEND_EMAIL, SAY_DONE]}})
    execute_run(str(forced.run_id))
    forced.refresh_from_db()
    return forced


@pytest.fixture(scope="module", autouse=True)
def _print_the_matrix(request):
    yield
    if not MATRIX and not RECOVERY_MATRIX:
        return
    lines = ["", "Crash matrix (agent, point × outcome, emails per run, counts):"]
    for agent, point in sorted(MATRIX):
        for outcome, count in sorted(MATRIX[(agent, point)].items()):
            lines.append(f"  {agent} ({point}) {POINTS[point]['label']}: {outcome} × {count}")
    if RECOVERY_MATRIX:
        lines.append("With recovery on (point: finished by itself, seconds from the kill to success in-process, emails):")
        for point, results in sorted(RECOVERY_MATRIX.items()):
            for by_itself, took, emails in results:
                lines.append(f"  ({point}) {POINTS[point]['label']}: {'yes' if by_itself else 'no, a person settled'}, "
                             f"{took:.1f} s, emails {emails}")
    text = "\n".join(lines)
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(text)
    output = os.environ.get("CRASH_MATRIX_OUTPUT")
    if output:
        with open(output, "w") as handle:
            json.dump(
                {
                    "repeats": REPEATS,
                    "points": {
                        str(point): {"label": POINTS[point]["label"], "outcomes": dict(MATRIX[("support", point)])}
                        for agent, point in sorted(MATRIX)
                        if agent == "support"
                    },
                    "with_recovery": {
                        str(point): [
                            {"finished_by_itself": by_itself, "seconds_to_success": round(took, 2), "emails": emails}
                            for by_itself, took, emails in results
                        ]
                        for point, results in sorted(RECOVERY_MATRIX.items())
                    },
                    # The same points for an agent loaded from AGENTS_DIR.
                    "loaded_agent_points": {
                        str(point): {"label": POINTS[point]["label"], "outcomes": dict(MATRIX[(agent, point)])}
                        for agent, point in sorted(MATRIX)
                        if agent != "support"
                    },
                },
                handle,
                indent=2,
            )
