import argparse

from django.core.management.base import BaseCommand, CommandError

from runs.upkeep import retention


def _whole_number(label: str):
    def parse(value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{label} must be a whole number, got {value!r}.") from None

    return parse


class Command(BaseCommand):
    help = (
        "Delete ADK session events older than the retention period, in batches (each its own short "
        "transaction). Sessions keep their shell; events of queued or running runs, run rows and "
        "the tool journal are kept."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--days", type=_whole_number("--days"), default=None,
            help="delete events older than this many days (default: EVENTS_RETENTION_DAYS)",
        )
        parser.add_argument(
            "--batch-size", type=_whole_number("--batch-size"), default=None,
            help=f"events per batch, 1 to {retention.MAX_BATCH_SIZE} (default: PURGE_BATCH_SIZE)",
        )
        parser.add_argument("--dry-run", action="store_true", help="count what would be deleted; delete nothing")

    def handle(self, *args, **options):
        def progress(report: retention.PurgeReport) -> None:
            rate = report.deleted / report.seconds if report.seconds else 0
            self.stdout.write(
                f"batch {report.batches}: {report.deleted} event(s) deleted so far "
                f"({report.batch_seconds[-1] * 1000:.0f} ms, {rate:.0f} events/s)"
            )

        try:
            if options["days"] is not None:
                retention.check_days(options["days"], name="--days")
            if options["batch_size"] is not None:
                retention.check_batch_size(options["batch_size"], name="--batch-size")
            report = retention.purge_events(
                days=options["days"],
                batch_size=options["batch_size"],
                dry_run=options["dry_run"],
                on_batch=progress,
            )
        except retention.PurgeConfigError as exc:
            raise CommandError(f"Nothing was deleted: {exc}") from None
        self.stdout.write(self.style.SUCCESS(str(report)))
