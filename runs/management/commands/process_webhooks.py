import time

from django.core.management.base import BaseCommand

from runs.inbox import processing
from runs.ledger import lifecycle


class Command(BaseCommand):
    help = (
        "Process due webhook events in this process: new ones, retries that are due, and events whose "
        "worker's lease ran out. Without --follow it stops when nothing is due."
    )

    def add_arguments(self, parser):
        parser.add_argument("--follow", action="store_true", help="keep polling for due events")
        parser.add_argument("--poll", type=float, default=0.5, help="seconds between polls with --follow (0.5)")
        parser.add_argument(
            "--max-idle", type=float, default=None,
            help="with --follow, stop after this many seconds without a due event",
        )

    def handle(self, *args, **options):
        worker = lifecycle.worker_name()
        total = 0
        idle_since = time.monotonic()
        while True:
            processed = processing.process_due(worker=worker)
            total += processed
            if processed:
                idle_since = time.monotonic()
            if not options["follow"]:
                break
            if options["max_idle"] is not None and time.monotonic() - idle_since > options["max_idle"]:
                break
            time.sleep(options["poll"])
        self.stdout.write(f"{total} webhook event(s) processed")
