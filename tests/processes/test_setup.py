"""Settings, commands, the ADK seam and the read-only admin."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connection
from django.urls import reverse

from agents.adk import adk_database_url
from runs.models.ledger import AgentRun, RunStatus
from runs.services import decisions
from tests.helpers import BASE_DIR, SAY_DONE, SEND_EMAIL, child_env, read_settings, run_manage, run_now, script_params

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
runs_for_real = pytest.mark.django_db(transaction=True)


def _django_setup_with(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=BASE_DIR,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("RUN_STALE_AFTER_SECONDS", "soon", "RUN_STALE_AFTER_SECONDS='soon' is not a whole number"),
        ("RUN_STALE_AFTER_SECONDS", "-5", "RUN_STALE_AFTER_SECONDS=-5 is too small"),
        ("MAX_UPLOAD_BYTES", "0", "MAX_UPLOAD_BYTES=0 is too small"),
        ("DEBUG", "maybe", "DEBUG='maybe' is not a boolean"),
        ("ADK_DB_POOL_SIZE", "three", "ADK_DB_POOL_SIZE='three'"),
        ("DATABASE_URL", "mysql://root@localhost/db", "SQLite or PostgreSQL only"),
        ("DATABASE_URL", "nonsense://", "DATABASE_URL='nonsense://'"),
        ("RUN_HEARTBEAT_SECONDS", "40", "more than twice"),
        ("AGENT_MODEL", "gemini-2.5-flash", "needs GOOGLE_API_KEY"),
        ("MODEL_RATE_LIMIT_RETRIES", "-1", "MODEL_RATE_LIMIT_RETRIES=-1 is too small"),
        ("EMPTY_TURN_RETRIES", "once", "EMPTY_TURN_RETRIES='once' is not a whole number"),
        ("MODEL_RETRY_MAX_WAIT_SECONDS", "a minute", "MODEL_RETRY_MAX_WAIT_SECONDS='a minute'"),
    ],
)
def test_a_bad_setting_stops_start_up_naming_the_variable(name, value, words):
    env = {name: value}
    if name == "AGENT_MODEL":
        env["GOOGLE_API_KEY"] = ""
    with pytest.raises(ImproperlyConfigured) as refused:
        read_settings(**env)
    assert words in str(refused.value)


@pytest.mark.django_db
def test_adk_uses_the_active_test_database():
    url = adk_database_url()
    assert url.database == str(connection.settings_dict["NAME"])
    assert url.drivername == ("sqlite+aiosqlite" if connection.vendor == "sqlite" else "postgresql+psycopg")


@pytest.mark.django_db
def test_migrate_makes_sure_adks_tables_exist():
    tables = set(connection.introspection.table_names())
    assert {"sessions", "events", "app_states", "user_states", "adk_internal_metadata"} <= tables


@pytest.mark.django_db(transaction=True)  # the pragmas are read outside a test transaction, as a connection has them
def test_sqlite_connections_use_wal_and_a_busy_timeout():
    if connection.vendor != "sqlite":
        pytest.skip("SQLite only")
    with connection.cursor() as cursor:
        assert cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert cursor.execute("PRAGMA busy_timeout").fetchone()[0] > 0

    from agents.adk import run_coroutine, session_service

    async def adk_pragmas():
        async with session_service().db_engine.connect() as conn:
            mode = (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar()
            timeout = (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar()
            return mode, timeout

    mode, timeout = run_coroutine(adk_pragmas())
    assert mode == "wal"
    assert timeout > 0


@pytest.mark.slow
@runs_for_real
def test_run_agent_command_prints_the_run_id_and_the_outcome():
    result = run_manage(
        "run_agent", "support", "Email Jane", "--owner", "alice", "--inline",
        "--script", json.dumps([SEND_EMAIL, SAY_DONE]),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    run = AgentRun.objects.get(pk=lines[0])
    assert run.status == RunStatus.SUCCESS
    assert "status: success" in lines
    assert "tools called: send_email" in lines


@runs_for_real
@pytest.mark.parametrize(
    "script, status, returncode",
    [
        ([{"fail": "error", "message": "The model broke."}], RunStatus.ERROR, 2),
        ([{"call": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 25_000}}, SAY_DONE],
         RunStatus.WAITING, 3),
    ],
)
def test_run_agent_wait_exits_non_zero_unless_the_run_succeeded(script, status, returncode, capsys):
    with pytest.raises(CommandError) as exited:
        call_command("run_agent", "support", "Refund A-1001", "--owner", "alice", "--inline",
                     "--script", json.dumps(script))
    assert exited.value.returncode == returncode
    run = AgentRun.objects.get()
    assert run.status == status
    assert f"status: {status}" in capsys.readouterr().out


@runs_for_real
@pytest.mark.parametrize(
    "args, words",
    [
        (["nope", "hi", "--owner", "alice"], "no agent named 'nope'"),
        (["support", "  ", "--owner", "alice"], "message is empty"),
        (["support", "hi", "--owner", "alice", "--script", "[{not json"], "--script is not valid JSON"),
        (["support", "hi", "--owner", "alice", "--script", '{"say": "x"}'], "must be a list"),
        (["support", "hi", "--owner", "alice", "--file", "/no/such/file"], "does not exist"),
    ],
)
def test_run_agent_refuses_bad_input_clearly(args, words):
    # In-process: the entry point itself is proven by the test above, which runs manage.py.
    with pytest.raises(CommandError) as refused:
        call_command("run_agent", *args)
    assert words in str(refused.value)
    assert AgentRun.objects.count() == 0


@runs_for_real
def test_run_agent_refuses_a_file_over_the_limit(tmp_path, settings):
    settings.MAX_UPLOAD_BYTES = 1024
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 2048)
    with pytest.raises(CommandError) as refused:
        call_command("run_agent", "support", "hi", "--owner", "alice", "--file", str(big))
    assert "larger than the limit of 1024 bytes" in str(refused.value)
    assert AgentRun.objects.count() == 0


@runs_for_real
def test_seed_demo_really_runs_the_agent_once():
    call_command("seed_demo")
    runs = {run.config["message"]: run for run in AgentRun.objects.filter(agent_name="support")}
    assert len(runs) == 4
    states = sorted((r.status, r.tools_state) for r in runs.values())
    assert states == [("error", "called"), ("error", "none"), ("success", "called"), ("waiting", "called")]
    # One waits on the desk for a person to approve a refund above the threshold.
    waiting = next(r for r in runs.values() if r.status == "waiting")
    assert list(waiting.pending_calls.values_list("tool_name", "decision")) == [("issue_refund", "")]
    failed_after = next(r for r in runs.values() if r.status == "error" and r.tools_executed)
    assert failed_after.tools_executed == ["lookup_customer", "send_email"]

    # And one run of the demo workflow, which fans out to two agents, joins, and ends with support.
    workflow_run = AgentRun.objects.get(agent_name="refund_review")
    assert (workflow_run.status, workflow_run.trigger) == ("success", "workflow")
    assert [s.step_name for s in workflow_run.steps.order_by("seq")][2:] == ["findings", "brief", "support"]

    call_command("seed_demo")
    assert AgentRun.objects.count() == 5


@pytest.mark.slow
@runs_for_real
def test_the_demo_ends_well_when_a_person_acts(admin_user):
    """The seeded failures are transient: a forced replay of the one that failed after send_email
    finishes with the email served from its record, a resume of the other finishes; a rejected
    refund is reported as not made."""
    from runs.execution import executor
    from runs.models.ledger import ToolCallStatus
    from runs.services import run as services

    call_command("seed_demo")
    runs = {run.config["message"]: run for run in AgentRun.objects.filter(agent_name="support")}
    after_email = runs["Omar's invoice is wrong."]
    replay = services.replay_run(after_email.run_id, actor=admin_user, force=True, reason="The demo's outage is over.")
    executor.execute(replay.run_id)
    replay.refresh_from_db()
    assert replay.status == RunStatus.SUCCESS, (replay.error_code, replay.error_message)
    assert replay.result == "I corrected Omar's invoice and emailed him about it."
    email = replay.tool_calls.get(tool_name="send_email")
    assert email.status == ToolCallStatus.DEDUPLICATED  # served from the original's record: sent once

    before_tools = runs["Omar cannot log in."]
    resumed = services.resume_run(before_tools.run_id, actor=admin_user)
    executor.execute(resumed.run_id)
    resumed.refresh_from_db()
    assert (resumed.status, resumed.result) == (RunStatus.SUCCESS, "I have sent Omar a link to reset his password.")

    waiting = runs["Jane was charged twice for order A-1001."]
    (pending,) = waiting.pending_calls.all()
    decisions.decide_call(run_id=waiting.run_id, call_id=pending.call_id, actor=admin_user, decision="reject",
                          note="Charged once only.")
    executor.execute(waiting.run_id)
    waiting.refresh_from_db()
    assert waiting.status == RunStatus.SUCCESS
    assert waiting.result == "The refund of 250.00 for order A-1001 was rejected, so no refund was made."
    assert waiting.tools_executed == ["lookup_customer"]


@pytest.mark.django_db
def test_ensure_admin_creates_the_superuser_once(monkeypatch, capsys, django_user_model):
    monkeypatch.setenv("ADMIN_PASSWORD", "s3cret-demo-pass")
    call_command("ensure_admin")
    admin = django_user_model.objects.get(username="admin")
    assert admin.is_superuser and admin.check_password("s3cret-demo-pass")

    monkeypatch.setenv("ADMIN_PASSWORD", "another")
    call_command("ensure_admin")
    admin.refresh_from_db()
    assert admin.check_password("s3cret-demo-pass")


@pytest.mark.django_db
def test_ensure_admin_prints_a_generated_password(monkeypatch, capsys, django_user_model):
    monkeypatch.delenv("ADMIN_PASSWORD", raising=False)
    call_command("ensure_admin")
    out = capsys.readouterr().out
    password = out.split("with password: ")[1].split()[0]
    assert django_user_model.objects.get(username="admin").check_password(password)


@runs_for_real
def test_runs_are_read_only_records_in_the_admin(admin_client):
    run = run_now(params=script_params(SEND_EMAIL, SAY_DONE))

    changelist = admin_client.get(reverse("admin:runs_agentrun_changelist"))
    assert changelist.status_code == 200
    assert str(run.run_id) in changelist.content.decode()

    page = admin_client.get(reverse("admin:runs_agentrun_change", args=[run.run_id]))
    assert page.status_code == 200
    body = page.content.decode()
    assert "send_email" in body
    assert 'name="_save"' not in body

    assert admin_client.get(reverse("admin:runs_agentrun_add")).status_code == 403
    assert admin_client.post(reverse("admin:runs_agentrun_delete", args=[run.run_id])).status_code == 403
    for model in ("adksession", "adkevent", "outboxemail", "crmnote"):
        assert admin_client.get(reverse(f"admin:agents_{model}_changelist")).status_code == 200
        assert admin_client.get(reverse(f"admin:agents_{model}_add")).status_code == 403


@pytest.mark.django_db
def test_ensure_admin_resets_a_lost_password(monkeypatch, capsys, django_user_model):
    monkeypatch.setenv("ADMIN_PASSWORD", "first-pass-123")
    call_command("ensure_admin")
    monkeypatch.delenv("ADMIN_PASSWORD")
    capsys.readouterr()
    call_command("ensure_admin")
    assert "ensure_admin --reset-password" in capsys.readouterr().out
    call_command("ensure_admin", "--reset-password")
    password = capsys.readouterr().out.split("New password for 'admin': ")[1].split()[0]
    admin = django_user_model.objects.get(username="admin")
    assert admin.check_password(password) and not admin.check_password("first-pass-123")
