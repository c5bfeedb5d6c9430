import io
import os
import signal
import socket
import subprocess
import sys
import time

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from agents.adk import release_process_resources
from agents.registry import AGENTS


def web_command(*, host: str, port: int, workers: int = 1) -> list[str]:
    """The ASGI server: async views stream, and a client that leaves is noticed (and its chat
    turn cancelled), which a WSGI server cannot do."""
    return [
        sys.executable, "-m", "uvicorn", "config.asgi:application",
        "--host", host, "--port", str(port), "--workers", str(workers), "--lifespan", "off",
        # REMOTE_ADDR stays the TCP peer; a trusted proxy's X-Forwarded-For is read by AXES_PROXY_COUNT alone.
        "--no-proxy-headers",
    ]


def agent_tools_line(spec) -> str:
    """Every agent of the tree with its tools: `desk: lookup_order, summarizer; refunds: issue_refund`."""
    nodes = list(spec.tree.walk()) if spec.tree is not None else []
    if len(nodes) <= 1:
        return ", ".join(spec.tool_names) or "no tools"
    return "; ".join(f"{node.name}: {', '.join(tool.name for tool in node.tools) or 'no tools'}" for node in nodes)


class Command(BaseCommand):
    help = (
        "Serve the app (ASGI, uvicorn), its worker processes (runworker) and the periodic jobs (django-q2's "
        "qcluster) together until Ctrl-C. For production run the three as separate services (see docs/scale.md)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--web-workers", type=int, default=1, help="uvicorn worker processes")
        parser.add_argument(
            "--setup",
            action="store_true",
            help="first migrate, set up the periodic jobs, ensure the admin user and seed the demo",
        )

    def set_up(self) -> str:
        """What `make run` needs before serving, in this one process: each step is idempotent, and
        one Django start-up instead of five is most of the time of a second start. Returns what
        ensure_admin said (a new password), printed once the server listens, where it stays in view."""
        call_command("migrate", interactive=False, stdout=self.stdout, stderr=self.stderr)
        admin_said = io.StringIO()
        for name in ("setup_schedules", "ensure_admin", "seed_demo"):
            out = admin_said if name == "ensure_admin" else self.stdout
            call_command(name, stdout=out, stderr=self.stderr)
        # The servers are other processes: this one keeps no connection (nor ADK pool) open.
        release_process_resources()
        connections.close_all()
        return admin_said.getvalue()

    def report_agents(self) -> None:
        """Load AGENTS_DIR once here so a broken package is said at start-up, not at its first run."""
        for name, spec in sorted(AGENTS.items()):
            if spec.load_error:
                self.stderr.write(self.style.ERROR(f"Agent {name} could not be loaded: {spec.load_error}"))
            else:
                self.stdout.write(f"Agent {name}: {agent_tools_line(spec)}")
            for error in spec.tool_errors:
                self.stderr.write(self.style.WARNING(f"Agent {name}: {error}"))

    def handle(self, *args, **options):
        admin_said = self.set_up() if options["setup"] else ""
        self.report_agents()
        python = sys.executable
        commands = {
            "web": web_command(host=options["host"], port=options["port"], workers=options["web_workers"]),
            "worker": [python, "manage.py", "runworker"],
            "periodic-job": [python, "manage.py", "qcluster"],
        }
        processes = {
            name: subprocess.Popen(command, cwd=settings.BASE_DIR, start_new_session=True)
            for name, command in commands.items()
        }
        listening = wait_until_listening(options["host"], options["port"], processes["web"])
        self.stdout.write(
            self.style.SUCCESS(
                f"Agent Ledger on http://{options['host']}:{options['port']}/admin/ "
                f"(worker: {settings.RUN_WORKER_PROCESSES} processes). Ctrl-C stops all three."
            )
            if listening
            else self.style.WARNING(
                f"The web server did not answer on {options['host']}:{options['port']} within "
                f"{LISTEN_WAIT_SECONDS:g} s; it may still be starting."
            )
        )
        if admin_said.strip():
            self.stdout.write(admin_said.rstrip("\n"))
        stopping = False
        forced = False

        def request_stop(signum, frame):
            nonlocal stopping, forced
            # A second Ctrl-C (or SIGTERM) while stopping stops at once.
            forced = stopping
            stopping = True

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)
        failed = None
        while not stopping:
            for name, process in processes.items():
                if process.poll() is not None:
                    failed = f"The {name} process exited with status {process.returncode}."
                    stopping = True
                    break
            time.sleep(0.5)
        # Only the leaders get SIGTERM: each one stops its own children in order (runworker's
        # processes drain their runs for RUN_DRAIN_SECONDS and abort the rest; qcluster finishes
        # its job); signalling the whole group at once makes qcluster hang.
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        grace = settings.RUN_DRAIN_SECONDS + STOP_MARGIN_SECONDS
        self.stdout.write(f"Stopping (at most {grace:g} s; Ctrl-C again to stop at once)…")
        deadline = time.monotonic() + grace
        # Wait for every process of each group, not only its leader: after workers were killed
        # under load, qcluster's children can outlive it, waiting for a monitor that never ends.
        while not forced and time.monotonic() < deadline and any(_group_alive(p) for p in processes.values()):
            time.sleep(0.2)
        for name, process in processes.items():
            if _group_alive(process):
                self.stderr.write(self.style.WARNING(f"The {name} processes did not stop in time: killing them."))
                _kill_group(process)
        if failed:
            raise CommandError(failed)


# How long serve waits for the web server to accept connections before it prints the address.
LISTEN_WAIT_SECONDS = 60


def wait_until_listening(host: str, port: int, process: subprocess.Popen) -> bool:
    """Whether the web server accepts connections on host:port (False: it exited, or the wait ran out)."""
    target = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    deadline = time.monotonic() + LISTEN_WAIT_SECONDS
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with socket.create_connection((target, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.2)
    return False


# Beyond the drain: the time a run aborted at the end of the drain needs to write its outcome, and
# django-q2 to stop its pusher and monitor.
STOP_MARGIN_SECONDS = 30


def _group_alive(process: subprocess.Popen) -> bool:
    """Whether any process of `process`'s group (its session, started by serve) still runs."""
    process.poll()  # reap the leader if it has exited, so it does not count as alive
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    process.wait(timeout=10)
