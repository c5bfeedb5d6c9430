"""The ledger is its own queue: wake-ups at commit, the workers' locks, and real workers taking work.

What one process can show runs on both databases (the claim itself is in tests/processes/test_concurrency.py);
the NOTIFY and the advisory locks are PostgreSQL's; `runworker` and `serve` run as real processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import httpx
import psycopg
import pytest
from django.db import connection, transaction
from rest_framework.authtoken.models import Token

from runs.ledger import lifecycle, presence, wakeup
from runs.models.inbox import EventStatus, WebhookEvent
from runs.models.ledger import AgentRun, RunStatus
from runs.services import run as services
from tests.chat.test_chat import _free_port
from tests.helpers import (
    BASE_DIR,
    SAY_DONE,
    child_env,
    postgres_only,
    script_params,
    start_workers,
    stop_group,
    wait_for_workers,
    wait_until,
    wait_until_serving,
)
from tests.inbox.test_webhooks import deliver, make_source

db = pytest.mark.django_db(transaction=True)


@pytest.fixture
def listener():
    found = wakeup.Listener()
    yield found
    found.close()


@postgres_only
@db
def test_a_started_run_wakes_the_workers_at_its_commit_and_not_before(listener):
    listener.connect()
    assert listener.wait(0) == set()
    with transaction.atomic():
        services.start_run(agent_name="support", message="hi", owner_id="alice")
        assert listener.wait(0.3) == set(), "told before the run was committed"
    assert wakeup.RUNS_CHANNEL in wait_until(lambda: listener.wait(0.5), timeout=10, what="the notification")


@postgres_only
@db
def test_a_rolled_back_run_wakes_nobody(listener):
    listener.connect()
    with pytest.raises(RuntimeError), transaction.atomic():
        services.start_run(agent_name="support", message="hi", owner_id="alice")
        raise RuntimeError("the caller gave up")
    assert listener.wait(0.5) == set()
    assert not AgentRun.objects.exists()


@postgres_only
@db
def test_a_worker_is_judged_gone_exactly_when_its_lock_is(listener):
    name = lifecycle.runworker_name(pid=4242)
    run = services.start_run(agent_name="support", message="hi", owner_id="alice", enqueue=False)
    lifecycle.claim_run(run_id=run.run_id, worker=name)
    listener.connect()
    assert presence.take(listener.connection, name)
    assert presence.gone_workers() == []
    assert presence.alive_workers() == 1
    # A second session cannot take the same name's lock while the first lives.
    with psycopg.connect(**wakeup.listener_connection_params(), autocommit=True) as other:
        assert not presence.take(other, name)
    listener.close()
    assert wait_until(lambda: presence.gone_workers(), timeout=10, what="the lock to go") == [name]
    assert presence.alive_workers() == 0
    # A name without the runworker mark holds no lock: only staleness judges it.
    lifecycle.claim_run(run_id=services.start_run(agent_name="support", message="hi", owner_id="alice",
                                                  enqueue=False).run_id, worker="web-1:7")
    assert presence.gone_workers() == [name]


@pytest.mark.slow
@postgres_only
@db
def test_runworker_processes_a_webhook_event_from_the_inbox_table(tmp_path, settings):
    make_source()
    workers = start_workers(tmp_path / "workers.log", WEBHOOK_ATTACHMENTS_DIR=str(settings.WEBHOOK_ATTACHMENTS_DIR))
    try:
        wait_for_workers(tmp_path / "workers.log", workers)
        response = deliver()
        assert response.status_code == 202, response.content
        event_id = response.json()["event_id"]
        wait_until(lambda: WebhookEvent.objects.get(pk=event_id).status == EventStatus.DONE, timeout=90,
                   what=f"the event to be done (log: {tmp_path / 'workers.log'})")
        (run,) = AgentRun.objects.filter(webhook_event_id=event_id)
        assert (run.status, run.trigger, run.attempts) == (RunStatus.SUCCESS, "webhook", 1)
        assert run.worker.endswith(lifecycle.WORKER_SUFFIX)
    finally:
        stop_group(workers)


def _kill_serve(serve: subprocess.Popen) -> None:
    """What is left of a `serve` a test gave up on. serve starts each of its processes in a session of
    its own: SIGKILL to its group reaches none of them, so each child's group is killed first."""
    if serve.poll() is not None:
        return
    for child in subprocess.run(["ps", "-o", "pid=", "--ppid", str(serve.pid)], capture_output=True,
                                text=True).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(child), signal.SIGKILL)
    stop_group(serve)


@pytest.mark.slow
@db
def test_serve_runs_the_web_the_workers_and_the_periodic_jobs_in_one_command(tmp_path, alice):
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "ab") as out:
        serve = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--port", str(port)], cwd=BASE_DIR,
            env=child_env(RUN_POLL_SECONDS="0.5", RUN_DRAIN_SECONDS="2"), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url, serve, log)
        token = Token.objects.create(user=alice).key
        started = httpx.post(f"{url}/api/runs/", headers={"Authorization": f"Token {token}"}, timeout=30, json={
            "agent": "support", "message": "Hi.", "owner_id": "alice", "params": script_params(SAY_DONE)})
        assert started.status_code == 202, started.text
        run_id = started.json()["run_id"]
        wait_until(lambda: AgentRun.objects.get(pk=run_id).status == RunStatus.SUCCESS, timeout=90,
                   what=f"a worker of serve to run it (log: {log})")
        commands = subprocess.run(["ps", "-o", "args=", "--ppid", str(serve.pid)], capture_output=True, text=True).stdout
        assert "runworker" in commands and "qcluster" in commands and "uvicorn" in commands, commands
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=90) == 0, log.read_text()[-3000:]
    finally:
        _kill_serve(serve)
        connection.close()


@pytest.mark.slow
@db
def test_serve_prints_the_address_and_a_new_password_once_the_server_listens(tmp_path, django_user_model):
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "ab") as out:
        serve = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--setup", "--port", str(port)], cwd=BASE_DIR,
            env=child_env(RUN_POLL_SECONDS="0.5", RUN_DRAIN_SECONDS="2", ADMIN_PASSWORD=""), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_until(lambda: "Keep it" in log.read_text(), timeout=120, what=f"serve to print the password (log: {log})")
        text = log.read_text()
        # The address and the password come last, after every line of the set-up, and the server
        # already answers when they are printed.
        address = text.index(f"Agent Ledger on http://127.0.0.1:{port}/admin/")
        password = text.split("with password: ")[1].split()[0]
        assert text.index("with password: ") > address > text.index("Agent support")
        assert httpx.get(f"http://127.0.0.1:{port}/admin/login/", timeout=10).status_code == 200
        assert len(password) >= 12 and django_user_model.objects.filter(username="admin", is_superuser=True).exists()
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=90) == 0, log.read_text()[-3000:]
    finally:
        _kill_serve(serve)
        connection.close()
