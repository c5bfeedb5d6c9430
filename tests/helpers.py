"""Helpers shared by the tests: child processes on the test database, runs executed in-process."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from unittest import mock

import httpx
import pytest
from django.conf import settings as django_settings
from django.db import connection

from runs.execution import executor
from runs.services import run as services

BASE_DIR = Path(django_settings.BASE_DIR)

postgres_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="needs PostgreSQL (set DATABASE_URL to a postgres:// URL)"
)


def child_database_url() -> str:
    """A DATABASE_URL for child processes that points at this test run's database."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] or ""
    if db.get("PASSWORD"):
        auth += f":{db['PASSWORD']}"
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    return f"postgres://{auth}@{host}:{port}/{db['NAME']}"


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=child_database_url(),
        SCRIPTED_FAULTS_ENABLED="true",
        SCRIPTS_FROM_USERS_ALLOWED="true",
        THROTTLE_RUNS_START="off",
        THROTTLE_REPLAYS="off",
        THROTTLE_CHAT_TURNS="off",
        AXES_ENABLED="false",
        RUN_INPUTS_DIR=str(django_settings.RUN_INPUTS_DIR),
        RUN_HEARTBEAT_SECONDS=str(django_settings.RUN_HEARTBEAT_SECONDS),
        EMAIL_BACKEND="django.core.mail.backends.locmem.EmailBackend",
        DJANGO_SETTINGS_MODULE="config.settings",
    )
    env.update(extra)
    return env


def read_settings(*, drop: tuple[str, ...] = (), **env: str) -> types.ModuleType:
    """config/settings.py executed afresh in this process, with a child's environment plus `env`
    and without `drop`: what a process started that way would read, or the ImproperlyConfigured
    it would stop with. Starting a process costs seconds; importing the settings, milliseconds."""
    environment = child_env(**env)
    for name in drop:
        environment.pop(name, None)
    spec = importlib.util.spec_from_file_location("config._settings_read_by_test", BASE_DIR / "config" / "settings.py")
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ, environment, clear=True):
        spec.loader.exec_module(module)
    return module


def run_manage(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=BASE_DIR,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_python(code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    prelude = "import django; django.setup()\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        cwd=BASE_DIR,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_now(**kwargs):
    """Start a run and execute it in this process, as a worker would; return the settled row."""
    kwargs.setdefault("agent_name", "support")
    kwargs.setdefault("owner_id", "alice")
    kwargs.setdefault("message", "Jane asks about her refund.")
    run = services.start_run(enqueue=False, **kwargs)
    executor.execute(run.run_id)
    run.refresh_from_db()
    return run


def script_params(*steps) -> dict:
    return {"script": list(steps)}


EMAIL_ARGS = {"to": "jane@example.com", "subject": "Refund", "body": "Your refund is on its way."}
SEND_EMAIL = {"call": "send_email", "args": EMAIL_ARGS}
UPDATE_CRM = {"call": "update_crm", "args": {"contact_id": "C-1001", "note": "Refund confirmed."}}
LOOKUP = {"call": "lookup_customer", "args": {"email": "jane@example.com"}}
SAY_DONE = {"say": "Done."}


# --- Agent packages written by a test and loaded through AGENTS_DIR --------------------------------

AGENT_PACKAGES = BASE_DIR / "tests" / "agent_packages"
MCP_SERVER = BASE_DIR / "tests" / "mcp_server.py"


def package_source(name: str) -> str:
    return (AGENT_PACKAGES / f"{name}.py").read_text()


def write_agent_packages(directory: Path, packages: dict[str, str]) -> Path:
    """Each package as `<directory>/<name>/agent.py`, the layout `adk web` reads."""
    for name, source in packages.items():
        (directory / name).mkdir(parents=True, exist_ok=True)
        (directory / name / "agent.py").write_text(source)
    return directory


def forget_agent_packages(directory: Path, names) -> None:
    """Undo what ADK's loader did for these packages: their modules and the sys.path entry."""
    for module in [m for m in sys.modules if m.split(".")[0] in set(names)]:
        del sys.modules[module]
    resolved = str(Path(directory).resolve())
    while resolved in sys.path:
        sys.path.remove(resolved)


def wait_until(predicate, *, timeout: float = 30, what: str = "the condition", step: float = 0.1):
    """Poll `predicate` until it returns something truthy (returned) or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(step)


def wait_until_serving(url: str, process, log_path, *, timeout: float = 60) -> None:
    """Wait until a server started by a test answers, or fail with the end of its log."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(f"{url}/admin/login/", timeout=2)
            return
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"the server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)


# --- Real worker processes (`runworker`), the periodic-job cluster, and the runs they leave ----------

_WORKER_STARTED = re.compile(r"Worker process (\d+) started")


def start_workers(log_path: Path, *, processes: int = 2, **env: str) -> subprocess.Popen:
    """`manage.py runworker` (two processes, a short poll) in its own session, its log in `log_path`."""
    env.setdefault("RUN_POLL_SECONDS", "0.5")
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "manage.py", "runworker", "--processes", str(processes)], cwd=BASE_DIR,
            env=child_env(**env), stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
        )


def worker_pids(log_path: Path) -> list[int]:
    """The pids of the worker processes a `runworker` started, oldest first (replacements included)."""
    return [int(match.group(1)) for match in _WORKER_STARTED.finditer(Path(log_path).read_text(errors="replace"))]


def wait_for_workers(log_path: Path, process: subprocess.Popen, *, processes: int = 2, timeout: float = 90) -> list[int]:
    """Wait until `processes` worker processes of the `runworker` are up; their pids."""

    def up():
        assert process.poll() is None, f"runworker stopped:\n{Path(log_path).read_text()[-3000:]}"
        pids = [pid for pid in worker_pids(log_path) if alive(pid)]
        return pids if len(pids) >= processes else None

    return wait_until(up, timeout=timeout, what="the worker processes to start")


def pid_of_worker(name: str) -> int:
    """The pid in a claim's worker name (`host:pid` or `host:pid/worker`)."""
    return int(name.rsplit(":", 1)[1].split("/", 1)[0])


def start_cluster(log_path: Path, **env: str) -> subprocess.Popen:
    """`manage.py qcluster` (the periodic jobs) in its own session, its log in `log_path`."""
    env.setdefault("Q_POLL_SECONDS", "0.1")
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "manage.py", "qcluster"], cwd=BASE_DIR, env=child_env(**env),
            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
        )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child not yet reaped by its parent is a zombie: dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def stop_group(process: subprocess.Popen) -> None:
    """SIGKILL `process` and every process of its session (a runworker and its children, a cluster)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)
    connection.close()


stop_cluster = stop_workers = stop_group


def chain_end(run):
    """The last run of `run`'s chain of resumes and replays (the run itself if it has none)."""
    from runs.models.ledger import AgentRun

    current = AgentRun.objects.get(pk=run.pk)
    while True:
        nxt = AgentRun.objects.filter(resume_of=current).first() or AgentRun.objects.filter(replay_of=current).first()
        if nxt is None:
            return current
        current = nxt


def chain_ids(run) -> list:
    """`run` and the runs that continue it (resumes, replays), in order."""
    from django.db.models import Q

    from runs.models.ledger import AgentRun

    ids, current = [run.pk], run
    while (nxt := AgentRun.objects.filter(Q(resume_of=current) | Q(replay_of=current)).first()) is not None:
        ids.append(nxt.pk)
        current = nxt
    return ids
