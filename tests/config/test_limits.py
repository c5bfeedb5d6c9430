"""Limits: bodies refused before they are read, request rates, work in flight, admin logins, faults.

The body limits are tested against the real server (uvicorn, as `manage.py serve` runs it) with
raw sockets, because the point is what the server reads, not what a view answers.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx
import pytest
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs.management.commands.serve import web_command
from runs.models.ledger import AgentRun, RunStatus, Trigger
from runs.services import run as services
from tests.factories import make_run
from tests.helpers import BASE_DIR, SAY_DONE, SEND_EMAIL, child_env, run_python, script_params, wait_until_serving
from tests.kit import api

# Live servers in child processes and runs on the agent loop read what the test committed.
pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = 64 * 1024


@dataclass(frozen=True)
class Server:
    port: int
    pid: int


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def spool_dir(tmp_path_factory) -> Path:
    return Path(tmp_path_factory.mktemp("spool"))


@pytest.fixture(scope="module")
def server(django_db_setup, tmp_path_factory, spool_dir):
    """The web process with small limits; its temp directory is one the test watches."""
    port = _free_port()
    log_path = Path(tmp_path_factory.mktemp("server")) / "uvicorn.log"
    env = child_env(
        WEBHOOK_MAX_BYTES=str(LIMIT), MAX_REQUEST_BODY_BYTES=str(LIMIT), MAX_UPLOAD_BYTES=str(LIMIT),
        TMPDIR=str(spool_dir), LOG_LEVEL="WARNING",
    )
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            web_command(host="127.0.0.1", port=port), cwd=BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    wait_until_serving(f"http://127.0.0.1:{port}", process, log_path)
    yield Server(port, process.pid)
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _spooled_bytes(pid: int, path: Path) -> int:
    """Bytes in files under `path` that process `pid` holds open (temporary files have no name in
    the directory, so the process's open files are what shows them)."""
    total = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith(str(path)):
                total += os.stat(fd).st_size
        except OSError:
            continue
    return total


class SpoolWatch:
    """Samples what the server has spooled to its temp directory while a request streams in."""

    def __init__(self, server: Server, path: Path):
        self.pid, self.path, self.peak = server.pid, path, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.peak = max(self.peak, _spooled_bytes(self.pid, self.path))
            except FileNotFoundError:
                continue

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()


def _read_response(sock: socket.socket, timeout: float = 10) -> tuple[int, dict]:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body[: _length(data)] or b"{}")


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _stream_chunked(port: int, path: str, *, total: int, headers: str = "") -> tuple[int, dict, int]:
    """Send a chunked body of `total` bytes until the server answers; (status, body, bytes sent)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}"
        "Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    piece = b"x" * 65536
    frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    sent = 0
    try:
        while sent < total:
            readable, writable, _ = select.select([sock], [sock], [], 10)
            if readable:
                break  # the server answered (or closed) before the body ended
            if writable:
                sock.sendall(frame)
                sent += len(piece)
        else:
            sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        status, body = _read_response(sock)
    finally:
        sock.close()
    return status, body, sent


def _declared(port: int, path: str, *, length: int, headers: str = "") -> tuple[int, dict, float]:
    """Declare a body of `length` bytes, send none of it, and time the answer."""
    sock = socket.create_connection(("127.0.0.1", port))
    started = time.monotonic()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {length}\r\n\r\n".encode()
    )
    try:
        status, body = _read_response(sock, timeout=10)
    finally:
        sock.close()
    return status, body, time.monotonic() - started


# --- Bodies refused before they are read --------------------------------------------------------------


@pytest.mark.slow
def test_a_declared_gigabyte_to_an_unknown_webhook_is_refused_without_reading_it(server, spool_dir):
    with SpoolWatch(server, spool_dir) as watch:
        status, body, seconds = _declared(server.port, "/api/webhooks/nonexistent/", length=1024**3)
    assert status == 413
    assert body["code"] == "body_too_large"
    assert f"{LIMIT} bytes (WEBHOOK_MAX_BYTES)" in body["detail"]
    assert seconds < 5  # answered at once: not one body byte was sent
    assert watch.peak == 0


@pytest.mark.slow
def test_a_chunked_body_to_a_webhook_is_cut_off_past_the_limit(server, spool_dir):
    with SpoolWatch(server, spool_dir) as watch:
        status, body, sent = _stream_chunked(server.port, "/api/webhooks/nonexistent/", total=256 * 1024 * 1024)
    assert status == 413
    assert body["code"] == "body_too_large"
    # The server stopped reading about at the limit; what the client got out before it heard the
    # answer is the limit plus what the kernel's socket buffers held.
    assert sent < 16 * 1024 * 1024, sent
    assert watch.peak < 1024 * 1024, watch.peak  # nothing spooled to the temp directory


@pytest.mark.slow
def test_an_anonymous_upload_of_200_megabytes_is_refused_before_authentication(server, spool_dir):
    multipart = "Content-Type: multipart/form-data; boundary=x\r\n"
    status, body, seconds = _declared(server.port, "/api/runs/", length=200 * 1024 * 1024, headers=multipart)
    assert (status, body["code"]) == (413, "request_too_large")
    assert "MAX_UPLOAD_BYTES" in body["detail"]
    assert seconds < 5
    with SpoolWatch(server, spool_dir) as watch:
        status, body, sent = _stream_chunked(server.port, "/api/runs/", total=200 * 1024 * 1024)
    assert (status, body["code"]) == (413, "request_too_large")
    assert "MAX_REQUEST_BODY_BYTES" in body["detail"]
    assert sent < 16 * 1024 * 1024
    assert watch.peak < 1024 * 1024


@pytest.mark.slow
def test_a_chunked_chat_turn_over_the_limit_is_refused(server):
    status, body, sent = _stream_chunked(server.port, "/api/chat/", total=64 * 1024 * 1024)
    assert (status, body["code"]) == (413, "request_too_large")
    assert sent < 16 * 1024 * 1024


@pytest.mark.slow
def test_a_body_within_the_limit_still_reaches_the_app(server):
    status, _body, _sent = _stream_chunked(server.port, "/api/runs/", total=2 * 65536)
    assert status == 413  # two chunks of 64 KiB are over a 64 KiB limit
    response = httpx.post(f"http://127.0.0.1:{server.port}/api/runs/", json={"agent": "support"}, timeout=10)
    assert response.status_code == 401  # under the limit: Django answers (no credentials)


def _chunked_request(port: int, path: str, body: bytes, *, headers: str = "", pieces: int = 3) -> tuple[int, dict]:
    """POST `body` in `pieces` chunks, no Content-Length, as a streaming client sends it."""
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n".encode()
        )
        size = -(-len(body) // pieces)
        for start in range(0, len(body), size):
            piece = body[start:start + size]
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        sock.sendall(b"0\r\n\r\n")
        return _read_response(sock)
    finally:
        sock.close()


@pytest.mark.slow
def test_a_chunked_json_run_is_read_as_sent(server, alice):
    token = Token.objects.create(user=alice).key
    body = json.dumps({"agent": "support", "message": "Where is my order?", "owner_id": alice.username}).encode()
    status, answer = _chunked_request(server.port, "/api/runs/", body, headers=f"Authorization: Token {token}\r\n")
    assert status == 202, answer
    run = AgentRun.objects.get(run_id=answer["run_id"])
    assert (run.agent_name, run.config["message"], run.created_by) == ("support", "Where is my order?", alice)


@pytest.mark.slow
def test_a_chunked_json_body_that_is_not_json_says_so(server, alice):
    token = Token.objects.create(user=alice).key
    status, answer = _chunked_request(server.port, "/api/runs/", b'{"agent": "support",',
                                      headers=f"Authorization: Token {token}\r\n")
    assert status == 400, answer
    assert "message" not in answer  # not "this field is required": the body was read, and it is not JSON
    assert answer["code"] == "parse_error", answer


def test_a_chunked_body_a_wsgi_server_cannot_read_is_a_411_saying_why(admin_client):
    # Under WSGI Django reads nothing of a body without a length; the test client is such a door.
    response = admin_client.generic(
        "POST", "/api/runs/", b'{"agent": "support"}', content_type="application/json",
        CONTENT_LENGTH="", HTTP_TRANSFER_ENCODING="chunked",
    )
    assert response.status_code == 411
    assert response.json()["code"] == "length_required"
    assert "Content-Length" in response.json()["detail"]
    assert not AgentRun.objects.exists()


def test_the_django_guard_refuses_a_declared_length_on_any_path(admin_client, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2048
    response = admin_client.generic(
        "POST", "/api/workflows/", b"{}", content_type="application/json", CONTENT_LENGTH="999999"
    )
    assert response.status_code == 413
    assert response.json()["code"] == "request_too_large"
    assert "2048 bytes (MAX_REQUEST_BODY_BYTES)" in response.json()["detail"]


# --- Request rates ------------------------------------------------------------------------------------


@pytest.fixture
def alice_token(alice) -> str:
    return Token.objects.create(user=alice).key


@pytest.fixture
def as_alice(alice_token) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {alice_token}")
    return client



def _rates(settings, **rates) -> None:
    settings.THROTTLE_RATES = {"runs.start": None, "runs.replay": None, "chat.turn": None, **rates}


RUN = {"agent": "support", "message": "Jane asks about her refund.", "owner_id": "jane"}


def test_starting_runs_is_throttled_per_user_with_retry_after(as_alice, bob, settings, no_worker):
    _rates(settings, **{"runs.start": "2/min"})
    assert [as_alice.post("/api/runs/", RUN, format="json").status_code for _ in range(2)] == [202, 202]
    third = as_alice.post("/api/runs/", RUN, format="json")
    assert third.status_code == 429
    assert third.json()["code"] == "throttled"
    assert 0 < int(third["Retry-After"]) <= 60
    assert AgentRun.objects.count() == 2
    # Per user: another user is not held back, and reading is never throttled.
    as_bob = api(bob)
    assert as_bob.post("/api/runs/", {**RUN, "owner_id": "bob"}, format="json").status_code == 202
    assert as_alice.get("/api/runs/").status_code == 200


def test_replays_are_throttled(as_alice, alice, settings, no_worker):
    _rates(settings, **{"runs.replay": "1/min"})
    first, second = make_run(created_by=alice, tools=[]), make_run(created_by=alice, tools=[])
    assert as_alice.post(f"/api/runs/{first.run_id}/replay/", {}, format="json").status_code == 202
    refused = as_alice.post(f"/api/runs/{second.run_id}/replay/", {}, format="json")
    assert refused.status_code == 429
    assert refused.json()["code"] == "throttled"
    assert refused.has_header("Retry-After")


def test_chat_turns_are_throttled(alice_token, settings):
    _rates(settings, **{"chat.turn": "1/min"})
    client = Client()
    body = json.dumps({"agent": "nobody", "owner_id": "jane", "message": "hi"})
    headers = {"HTTP_AUTHORIZATION": f"Token {alice_token}"}
    assert client.post("/api/chat/", body, content_type="application/json", **headers).status_code == 400
    refused = client.post("/api/chat/", body, content_type="application/json", **headers)
    assert refused.status_code == 429
    assert refused.json()["code"] == "throttled"
    assert int(refused["Retry-After"]) >= 1


# --- Work in flight ----------------------------------------------------------------------------------


def test_runs_in_flight_per_user_are_capped(as_alice, alice, bob, settings, no_worker):
    failed = make_run(created_by=alice, tools=[])
    settings.MAX_RUNS_IN_FLIGHT_PER_USER = 2
    assert [as_alice.post("/api/runs/", RUN, format="json").status_code for _ in range(2)] == [202, 202]
    refused = as_alice.post("/api/runs/", RUN, format="json")
    assert refused.status_code == 429
    assert refused.json()["code"] == "too_many_runs_in_flight"
    assert "MAX_RUNS_IN_FLIGHT_PER_USER=2" in refused.json()["detail"]
    # Replays are runs too.
    assert as_alice.post(f"/api/runs/{failed.run_id}/replay/", {}, format="json").json()["code"] == (
        "too_many_runs_in_flight"
    )
    assert AgentRun.objects.filter(created_by=alice, status=RunStatus.QUEUED).count() == 2
    # Settled runs do not count, and nor do other users' runs.
    AgentRun.objects.filter(created_by=alice).update(status=RunStatus.CANCELLED)
    assert as_alice.post("/api/runs/", RUN, format="json").status_code == 202
    assert services.start_run(agent_name="support", message="hi", owner_id="bob", created_by=bob, enqueue=False)


def test_open_chat_streams_per_user_are_capped(alice, alice_token, settings):
    settings.MAX_CHAT_STREAMS_PER_USER = 1
    services.start_run(agent_name="support", message="hi", owner_id="jane", created_by=alice,
                       trigger=Trigger.CHAT, conversation_id="c", enqueue=False)
    response = Client().post(
        "/api/chat/", json.dumps({"agent": "support", "owner_id": "jane", "message": "Hello"}),
        content_type="application/json", HTTP_AUTHORIZATION=f"Token {alice_token}",
    )
    assert response.status_code == 429
    assert response.json()["code"] == "too_many_chat_streams"
    assert AgentRun.objects.count() == 1


# --- Admin logins (django-axes) ------------------------------------------------------------------------


def test_repeated_bad_admin_logins_lock_the_login(django_user_model, settings):
    settings.AXES_ENABLED = True
    settings.LOGIN_FAILURE_LIMIT = 3
    django_user_model.objects.create_user("staff", password="right-pass-123", is_staff=True, is_superuser=True)
    client = Client()
    for _ in range(3):
        response = client.post("/admin/login/?next=/admin/", {"username": "staff", "password": "wrong"})
        assert response.status_code in {200, 429}
    locked = client.post("/admin/login/?next=/admin/", {"username": "staff", "password": "right-pass-123"})
    assert locked.status_code == 429
    assert "_auth_user_id" not in client.session
    # Another account from the same address is not locked out by it.
    django_user_model.objects.create_user("other", password="other-pass-123", is_staff=True)
    ok = Client().post("/admin/login/?next=/admin/", {"username": "other", "password": "other-pass-123"})
    assert ok.status_code == 302


def test_a_good_admin_login_still_works_with_axes_enabled(django_user_model, settings):
    settings.AXES_ENABLED = True
    django_user_model.objects.create_user("staff", password="right-pass-123", is_staff=True)
    response = Client().post("/admin/login/?next=/admin/", {"username": "staff", "password": "right-pass-123"})
    assert response.status_code == 302


# --- Faults and scripts --------------------------------------------------------------------------------


@pytest.mark.slow
def test_faults_are_off_unless_set_explicitly_even_under_debug():
    result = run_python(
        "from django.conf import settings; print(settings.SCRIPTED_FAULTS_ENABLED)",
        DEBUG="true", SCRIPTED_FAULTS_ENABLED="",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_a_chat_turn_with_a_crash_fault_is_refused(alice_token):
    crash = dict(SEND_EMAIL, crash="before_effect")
    response = Client().post(
        "/api/chat/",
        json.dumps({"agent": "support", "owner_id": "jane", "message": "hi", "params": script_params(crash, SAY_DONE)}),
        content_type="application/json", HTTP_AUTHORIZATION=f"Token {alice_token}",
    )
    assert response.status_code == 400
    assert "crash" in response.json()["errors"]["params"][0]
    assert AgentRun.objects.count() == 0


@pytest.mark.slow
def test_a_crash_fault_never_kills_a_web_process():
    code = (
        "import asyncio\n"
        "from config.lib.process import mark_web_process\n"
        "from agents import faults\n"
        "mark_web_process()\n"
        "asyncio.run(faults.before_effect({'crash': 'before_effect'}))\n"
        "asyncio.run(faults.after_effect({'crash': 'after_effect'}))\n"
        "print('still here')\n"
    )
    result = run_python(code, SCRIPTED_FAULTS_ENABLED="true")
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "still here" in result.stdout


@pytest.mark.slow
def test_the_live_web_server_survives_a_chat_turn_that_asks_for_a_crash(server, alice_token):
    crash = dict(SEND_EMAIL, crash="before_effect")
    response = httpx.post(
        f"http://127.0.0.1:{server.port}/api/chat/",
        json={"agent": "support", "owner_id": "jane", "message": "hi", "params": script_params(crash, SAY_DONE)},
        headers={"Authorization": f"Token {alice_token}"}, timeout=30,
    )
    assert response.status_code == 400
    assert httpx.get(f"http://127.0.0.1:{server.port}/admin/login/", timeout=5).status_code == 200


def test_scripts_from_api_users_are_refused_unless_allowed(as_alice, alice_token, settings, no_worker):
    settings.SCRIPTS_FROM_USERS_ALLOWED = False
    body = {**RUN, "params": script_params(SEND_EMAIL, SAY_DONE)}
    refused = as_alice.post("/api/runs/", body, format="json")
    assert refused.status_code == 400
    assert "SCRIPTS_FROM_USERS_ALLOWED" in refused.json()["errors"]["params"][0]
    chat = Client().post("/api/chat/", json.dumps(body), content_type="application/json",
                         HTTP_AUTHORIZATION=f"Token {alice_token}")
    assert chat.status_code == 400
    assert "SCRIPTS_FROM_USERS_ALLOWED" in chat.json()["errors"]["params"][0]
    assert AgentRun.objects.count() == 0
    # Without a script the agent plays its own; staff-configured doors still take scripts.
    assert as_alice.post("/api/runs/", RUN, format="json").status_code == 202
    assert services.start_run(agent_name="support", message="hi", owner_id="jane",
                              params=script_params(SAY_DONE), enqueue=False)
