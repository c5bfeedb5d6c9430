"""Deployment: start-up refusals, HTTPS settings, `check --deploy`, what errors show, stored files,
the schema's audience and the retention of stored inputs."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
from datetime import timedelta
from io import BytesIO
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import Client, RequestFactory
from django.utils import timezone
from rest_framework.test import APIClient

from runs.inbox import receipt as inbox_receipt
from runs.inbox import signing
from runs.models.inbox import EventStatus, WebhookEvent, WebhookSource
from runs.models.ledger import AgentRun, RunStatus
from runs.services import run as services
from runs.upkeep import stored_data as data_retention
from runs.upkeep.periodic_jobs import JOBS
from tests.factories import make_run
from tests.helpers import BASE_DIR, SAY_DONE, child_env, read_settings
from tests.kit import api, login

# Child processes and runs executed on the agent loop read the test database through their own connections.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed

PRODUCTION = {
    "DEBUG": "false",
    "SECRET_KEY": "k3y-" + "Zq8xR2mW9pL4vN7tB1cY6hJ3sD5fG0aK" * 2,
    "ALLOWED_HOSTS": "ledger.example.com",
    "CSRF_TRUSTED_ORIGINS": "https://ledger.example.com",
    "SECURE_SSL_REDIRECT": "true",
    "SECURE_HSTS_SECONDS": "31536000",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": "true",
    "SECURE_HSTS_PRELOAD": "true",
    "SESSION_COOKIE_SECURE": "true",
    "CSRF_COOKIE_SECURE": "true",
    "SECURE_PROXY_SSL_HEADER": "HTTP_X_FORWARDED_PROTO,https",
}


def _python(code: str, *, drop: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
    environment = child_env(**env)
    for name in drop:
        environment.pop(name, None)
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup()\n" + code],
        cwd=BASE_DIR, env=environment, capture_output=True, text=True, timeout=60, check=False,
    )


# --- Start-up -----------------------------------------------------------------------------------------


@pytest.mark.slow
@committed
def test_production_without_a_secret_key_refuses_to_start_naming_it():
    # The one refusal seen from a real entry point; the others are read in-process (read_settings).
    environment = {name: value for name, value in child_env(DEBUG="false").items() if name != "SECRET_KEY"}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=BASE_DIR, env=environment,
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "SECRET_KEY is not set" in result.stderr
    assert read_settings(drop=("SECRET_KEY",), DEBUG="true").SECRET_KEY.startswith("django-insecure-")


@pytest.mark.slow
@committed
def test_importing_settings_writes_no_file(tmp_path):
    var_dir = tmp_path / "var"
    code = "from django.conf import settings; print(settings.SECRET_KEY)"
    first = _python(code, drop=("SECRET_KEY", "STATIC_ROOT"), DEBUG="true", VAR_DIR=str(var_dir))
    second = _python(code, drop=("SECRET_KEY", "STATIC_ROOT"), DEBUG="true", VAR_DIR=str(var_dir))
    assert first.returncode == 0, first.stderr[-2000:]
    assert not var_dir.exists()  # no generated key file, no static folder
    # The development key is the same in every process (web and worker must agree on it).
    assert first.stdout.split()[-1] == second.stdout.split()[-1]
    assert first.stdout.split()[-1].startswith("django-insecure-")


def test_https_and_cookie_settings_come_from_the_environment():
    s = read_settings(**PRODUCTION)
    assert (
        s.SECURE_SSL_REDIRECT, s.SECURE_HSTS_SECONDS, s.SECURE_HSTS_INCLUDE_SUBDOMAINS, s.SECURE_HSTS_PRELOAD,
        s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_PROXY_SSL_HEADER, s.CSRF_TRUSTED_ORIGINS,
    ) == (True, 31536000, True, True, True, True, ("HTTP_X_FORWARDED_PROTO", "https"), ["https://ledger.example.com"])


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("SECURE_PROXY_SSL_HEADER", "X-Forwarded-Proto", "SECURE_PROXY_SSL_HEADER='X-Forwarded-Proto' must be"),
        ("THROTTLE_RUNS_START", "fast", "THROTTLE_RUNS_START='fast' is not a rate"),
        ("THROTTLE_CHAT_TURNS", "10/fortnight", "THROTTLE_CHAT_TURNS='10/fortnight'"),
        ("MAX_RUNS_IN_FLIGHT_PER_USER", "-1", "MAX_RUNS_IN_FLIGHT_PER_USER=-1 is too small"),
        ("API_SCHEMA_PUBLIC", "perhaps", "API_SCHEMA_PUBLIC='perhaps' is not a boolean"),
        ("SCRIPTS_FROM_USERS_ALLOWED", "sometimes", "SCRIPTS_FROM_USERS_ALLOWED='sometimes'"),
    ],
)
def test_a_bad_security_setting_stops_start_up_naming_it(name, value, words):
    with pytest.raises(ImproperlyConfigured) as refused:
        read_settings(**{name: value})
    assert words in str(refused.value)


def test_a_bad_database_url_is_reported_without_its_password():
    with pytest.raises(ImproperlyConfigured) as refused:
        read_settings(DATABASE_URL="mysql://admin:hunter2-secret@db.example.com/ledger")
    assert "SQLite or PostgreSQL only" in str(refused.value)
    assert "hunter2-secret" not in str(refused.value)


@pytest.mark.slow
@committed
def test_check_deploy_is_clean_with_the_documented_production_settings():
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=BASE_DIR, env=child_env(**PRODUCTION), capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout
    # And it does flag a deployment that forgot them.
    bare = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=BASE_DIR, env=child_env(DEBUG="false"), capture_output=True, text=True, timeout=120, check=False,
    )
    assert bare.returncode != 0
    assert "security.W004" in bare.stdout + bare.stderr


# --- What errors show ----------------------------------------------------------------------------------


def test_the_debug_page_never_shows_the_database_password(settings):
    from django.views.debug import technical_500_response

    settings.DEBUG = True
    # Each secret is spelled in two pieces, so that the page's excerpt of this very source file
    # cannot be what shows it: only a value the filter failed to hide can.
    settings.DATABASE_URL = "postgres://ledger:hunter2" + "-secret@db.internal:5432/ledger"
    settings.CACHE_URL = "redis://:another" + "-secret@cache.internal:6379/0"
    request = RequestFactory().get("/admin/", HTTP_X_DSN="postgres://u:header" + "-secret@h/db")
    dsn = "host=db.internal user=ledger password=frame" + "-secret dbname=ledger"  # noqa: F841 (a local shown)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        page = technical_500_response(request, *sys.exc_info()).content.decode()
    assert "boom" in page  # it is the debug page
    for secret in ("hunter2" + "-secret", "another" + "-secret", "header" + "-secret", "frame" + "-secret"):
        assert secret not in page, secret


def test_an_internal_error_under_debug_is_summarised_to_api_clients(no_worker, alice, settings, monkeypatch):
    from runs.ledger import timeline

    def broken(run):
        raise RuntimeError("password=frame-secret in the exception text")

    settings.DEBUG = True
    monkeypatch.setattr(timeline, "run_events", broken)
    run = make_run(created_by=alice, tools=[])
    client = APIClient(raise_request_exception=False)
    client.force_authenticate(alice)
    response = client.get(f"/api/runs/{run.run_id}/events/")
    assert response.status_code == 500
    assert response["Content-Type"] == "application/json"
    assert response.json()["code"] == "server_error"
    assert "frame-secret" not in response.content.decode()


# --- Stored files -------------------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_run_input_copies_are_not_world_readable(no_worker):
    old_umask = os.umask(0o002)  # a permissive umask must not make them readable either
    try:
        run = services.start_run(agent_name="support", message="hi", owner_id="jane", file=BytesIO(b"secret"),
                                 file_name="contract.pdf", enqueue=False)
    finally:
        os.umask(old_umask)
    stored = Path(run.input_file)
    assert _mode(stored) == 0o600
    assert _mode(stored.parent) == 0o700
    assert _mode(stored.parent.parent) == 0o700  # RUN_INPUTS_DIR itself, created on the way


def test_webhook_attachment_copies_are_not_world_readable(no_inbox_worker, settings, tmp_path):
    settings.WEBHOOK_ATTACHMENTS_DIR = tmp_path / "attachments"
    source = WebhookSource.objects.create(slug="in", name="In", agent_name="support", owner_id="jane",
                                          secret="s" * 20, message_id_header="X-Message-Id",
                                          expects_attachments=True)
    body = json.dumps({"attachments": [{"filename": "a.txt", "content_base64": base64.b64encode(b"x").decode()}]})
    receipt = inbox_receipt.receive_event(slug=source.slug, body=body.encode(),
                                     headers={"X-Signature": signing.sign_timestamped("s" * 20, body.encode(),
                                                                                      message_id="m1"),
                                              "X-Message-Id": "m1"})
    stored = Path(receipt.event.attachments[0]["path"])
    assert _mode(stored) == 0o600
    assert _mode(stored.parent) == 0o700
    assert _mode(settings.WEBHOOK_ATTACHMENTS_DIR) == 0o700


def test_mail_files_and_their_folder_are_private(settings, tmp_path):
    from django.core import mail

    settings.EMAIL_BACKEND = "config.lib.mail.PrivateFileEmailBackend"
    settings.EMAIL_FILE_PATH = str(tmp_path / "var" / "mail")
    old_umask = os.umask(0o002)
    try:
        mail.send_mail("Refund", "Your refund is on its way.", "support@example.com", ["jane@example.com"])
    finally:
        os.umask(old_umask)
    folder = tmp_path / "var" / "mail"
    [written] = list(folder.iterdir())
    assert "Your refund is on its way." in written.read_text()
    assert _mode(written) == 0o600
    assert _mode(folder) == 0o700
    assert _mode(folder.parent) == 0o700


@committed
def test_the_default_mail_backend_is_the_private_one():
    result = _python("from django.conf import settings; print(settings.EMAIL_BACKEND)", drop=("EMAIL_BACKEND",))
    assert result.stdout.split()[-1] == "config.lib.mail.PrivateFileEmailBackend", result.stderr[-2000:]


@committed
def test_sqlite_files_are_private_from_the_first_connection(tmp_path):
    database = tmp_path / "ledger.sqlite3"
    # Modes are read in the child: SQLite removes its -wal and -shm files when the last connection closes.
    code = (
        "import os, stat\nos.umask(0o022)\nfrom django.db import connection\n"
        "connection.cursor().execute('CREATE TABLE t (x int)')\n"
        "connection.cursor().execute('INSERT INTO t VALUES (1)')\n"
        "folder = os.path.dirname(connection.settings_dict['NAME'])\n"
        "for name in sorted(os.listdir(folder)):\n"
        "    print(name, oct(stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode)))"
    )
    result = _python(code, DATABASE_URL=f"sqlite:///{database}")
    assert result.returncode == 0, result.stderr[-2000:]
    modes = dict(line.split() for line in result.stdout.strip().splitlines())
    assert {"ledger.sqlite3", "ledger.sqlite3-wal"} <= set(modes), modes
    assert set(modes.values()) == {"0o600"}, modes


# --- The schema's audience ------------------------------------------------------------------------------


def test_the_schema_and_docs_need_a_signed_in_user_unless_public(alice, settings):
    anonymous = Client()
    assert anonymous.get("/api/schema/").status_code == 401
    assert anonymous.get("/api/docs/").status_code == 401
    signed_in = login(alice)
    assert signed_in.get("/api/schema/").status_code == 200
    settings.API_SCHEMA_PUBLIC = True
    assert anonymous.get("/api/schema/").status_code == 200
    assert anonymous.get("/api/docs/").status_code == 200


# --- Retention of stored inputs -------------------------------------------------------------------------


def test_the_retention_job_is_a_daily_periodic_job():
    job = next(job for job in JOBS if job.name == "runs.purge_stored_inputs")
    assert job.func == "runs.tasks.purge_stored_inputs"
    assert job.cron.split()[2:] == ["*", "*", "*"]


@pytest.fixture
def inbox(no_inbox_worker, no_worker, settings, tmp_path):
    settings.WEBHOOK_ATTACHMENTS_DIR = tmp_path / "attachments"
    return WebhookSource.objects.create(slug="in", name="In", agent_name="support", owner_id="jane",
                                        secret="s" * 20, message_id_header="X-Message-Id",
                                        expects_attachments=True, params={"script": [SAY_DONE]})


def _event(source, message_id: str, *, status: str, days_ago: int, run_status: str | None = None) -> WebhookEvent:
    body = json.dumps({"text": message_id,
                       "attachments": [{"filename": "a.txt", "content_base64": base64.b64encode(b"x").decode()}]})
    event = inbox_receipt.receive_event(
        slug=source.slug, body=body.encode(),
        headers={"X-Signature": signing.sign_timestamped("s" * 20, body.encode(), message_id=message_id),
                 "X-Message-Id": message_id},
    ).event
    finished = timezone.now() - timedelta(days=days_ago)
    WebhookEvent.objects.filter(pk=event.pk).update(status=status, finished_at=finished)
    if run_status is not None:
        run = services.start_run(agent_name="support", message="m", owner_id="jane", enqueue=False)
        AgentRun.objects.filter(pk=run.pk).update(webhook_event=event, status=run_status,
                                                  finished_at=finished if run_status != RunStatus.QUEUED else None)
    event.refresh_from_db()
    return event


def test_old_closed_webhook_events_go_with_their_attachments_and_nothing_unsettled_does(inbox, settings):
    settings.WEBHOOK_EVENTS_RETENTION_DAYS = 90
    settings.WEBHOOK_ATTACHMENTS_RETENTION_DAYS = 30
    old_done = _event(inbox, "old-done", status=EventStatus.DONE, days_ago=100, run_status=RunStatus.SUCCESS)
    old_queued = _event(inbox, "old-queued-run", status=EventStatus.DONE, days_ago=100, run_status=RunStatus.QUEUED)
    old_review = _event(inbox, "old-review", status=EventStatus.NEEDS_REVIEW, days_ago=100)
    month_old = _event(inbox, "month-old", status=EventStatus.RESOLVED, days_ago=40)
    recent = _event(inbox, "recent", status=EventStatus.DONE, days_ago=2)
    folder = {e.external_id: Path(e.attachments[0]["path"]).parent for e in (old_done, old_queued, month_old, recent)}

    report = data_retention.purge_stored_inputs()

    assert not WebhookEvent.objects.filter(pk=old_done.pk).exists()
    assert not folder["old-done"].exists()
    run = AgentRun.objects.get(config__message="m", status=RunStatus.SUCCESS)
    assert run.webhook_event_id is None  # the run stays, unlinked
    # An event whose run is still queued, or that waits for a person, is kept whole.
    assert WebhookEvent.objects.filter(pk=old_queued.pk).exists() and folder["old-queued-run"].exists()
    assert WebhookEvent.objects.filter(pk=old_review.pk).exists()
    # Past the attachments' retention only the copies go; the event keeps what they were.
    month_old.refresh_from_db()
    assert not folder["month-old"].exists()
    assert month_old.attachments[0]["purged"] is True and "path" not in month_old.attachments[0]
    assert month_old.attachments[0]["filename"] == "a.txt"
    assert folder["recent"].exists()
    assert (report.events_deleted, report.attachment_folders_deleted) == (1, 2)  # old-done's copies went first
    # Running it again finds nothing more to do.
    again = data_retention.purge_stored_inputs()
    assert (again.events_deleted, again.attachment_folders_deleted, again.run_inputs_deleted) == (0, 0, 0)


def test_old_run_input_copies_go_only_when_every_run_using_them_has_settled(no_worker, settings, alice):
    settings.RUN_INPUTS_RETENTION_DAYS = 90
    long_ago = timezone.now() - timedelta(days=120)
    old = make_run(created_by=alice, tools=[], file=b"old input")
    AgentRun.objects.filter(pk=old.pk).update(finished_at=long_ago)
    shared = make_run(created_by=alice, tools=[], file=b"shared input")
    AgentRun.objects.filter(pk=shared.pk).update(finished_at=long_ago)
    replay = services.replay_run(shared.run_id, actor=alice)  # queued: it still needs the copy
    recent = make_run(created_by=alice, tools=[], file=b"recent input")

    report = data_retention.purge_stored_inputs()

    assert report.run_inputs_deleted == 1
    assert not Path(old.input_file).exists()
    assert Path(shared.input_file).exists() and replay.status == RunStatus.QUEUED
    assert Path(recent.input_file).exists()
    # The run row stays; a replay now says the input is gone instead of replaying without it.
    old.refresh_from_db()
    assert old.input_file_name
    client = api(alice)
    assert client.post(f"/api/runs/{old.run_id}/replay/", {}, format="json").json()["code"] == "input_gone"
