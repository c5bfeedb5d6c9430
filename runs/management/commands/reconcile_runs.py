from django.core.management.base import BaseCommand

from runs import reconcile


class Command(BaseCommand):
    help = (
        "Reconcile stale running runs now (error/reconciled, with the tools the journal proves "
        "they called) and enqueue again runs stuck in queued. Prints every run it reconciled."
    )

    def handle(self, *args, **options):
        def printed(run) -> None:
            self.stdout.write(f"reconciled {reconcile.describe([run])[0]}")

        report = reconcile.sweep(on_reconciled=printed)
        for run_id in report.requeued:
            self.stdout.write(f"enqueued again {run_id} (still queued after RUN_REQUEUE_AFTER_SECONDS)")
        self.stdout.write(self.style.SUCCESS(str(report).capitalize() + "."))
