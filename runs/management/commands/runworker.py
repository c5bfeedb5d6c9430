from django.conf import settings
from django.core.management.base import BaseCommand

from runs.worker.processes import Supervisor


class Command(BaseCommand):
    help = (
        "Run the worker processes of this machine: each claims queued runs (up to RUN_CONCURRENCY at once) "
        "and due webhook events from the ledger. A process that dies is replaced at once, its runs "
        "reconciled and continued; SIGTERM drains them (RUN_DRAIN_SECONDS). Run one per machine."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--processes", type=int, default=settings.RUN_WORKER_PROCESSES,
            help="worker processes (default RUN_WORKER_PROCESSES)",
        )
        parser.add_argument(
            "--concurrency", type=int, default=settings.RUN_CONCURRENCY,
            help="runs in flight per process (default RUN_CONCURRENCY)",
        )

    def handle(self, *args, **options):
        processes, concurrency = max(1, options["processes"]), max(1, options["concurrency"])
        self.stdout.write(f"Worker: {processes} process(es), up to {concurrency} run(s) each.")
        self.stdout.flush()
        Supervisor(processes=processes, capacity=concurrency).run()
