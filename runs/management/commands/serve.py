import os
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from agents.registry import AGENTS


def web_command(*, host: str, port: int, workers: int = 1) -> list[str]:
    """The ASGI server: async views stream, and a client that leaves is noticed (and its chat
    turn cancelled), which a WSGI server cannot do."""
    return [
        sys.executable, "-m", "uvicorn", "config.asgi:application",
        "--host", host, "--port", str(port), "--workers", str(workers), "--lifespan", "off",
    ]


class Command(BaseCommand):
    help = (
        "Serve the app (ASGI, uvicorn) and its django-q2 worker together until Ctrl-C. "
        "For production run the two as separate services (see the README)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--web-workers", type=int, default=1, help="uvicorn worker processes")

    def report_agents(self) -> None:
        """Load AGENTS_DIR once here so a broken package is said at start-up, not at its first run."""
        for name, spec in sorted(AGENTS.items()):
            if spec.load_error:
                self.stderr.write(self.style.ERROR(f"Agent {name} could not be loaded: {spec.load_error}"))
            else:
                self.stdout.write(f"Agent {name}: {', '.join(spec.tool_names) or 'no tools'}")
            for error in spec.tool_errors:
                self.stderr.write(self.style.WARNING(f"Agent {name}: {error}"))

    def handle(self, *args, **options):
        self.report_agents()
        python = sys.executable
        commands = {
            "web": web_command(host=options["host"], port=options["port"], workers=options["web_workers"]),
            "worker": [python, "manage.py", "qcluster"],
        }
        processes = {
            name: subprocess.Popen(command, cwd=settings.BASE_DIR, start_new_session=True)
            for name, command in commands.items()
        }
        self.stdout.write(
            self.style.SUCCESS(
                f"Agent Ledger on http://{options['host']}:{options['port']}/admin/ "
                f"(worker: {settings.Q_WORKERS} processes). Ctrl-C stops both."
            )
        )
        stopping = False

        def request_stop(signum, frame):
            nonlocal stopping
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
        # Only the leaders get SIGTERM: each one stops its own children in order (django-q2's
        # workers finish their task first); signalling the whole group makes qcluster hang.
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 30
        for process in processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        if failed:
            raise CommandError(failed)
