from django.core.management.base import BaseCommand

from runs.ledger import reconcile
from runs.upkeep import recovery


class Command(BaseCommand):
    help = (
        "Reconcile stale running runs now (error/reconciled, with the tools the journal proves "
        "they called), and continue the runs that died when nothing "
        "needs a person (RUN_RECOVERY). Prints every run it reconciled or continued."
    )

    def handle(self, *args, **options):
        def printed(run) -> None:
            self.stdout.write(f"reconciled {reconcile.describe([run])[0]}")

        report = reconcile.sweep(on_reconciled=printed)
        for resumed in recovery.recover_due():
            self.stdout.write(f"continued {resumed.resume_of_id} as {resumed.run_id} (nothing of it was in doubt)")
        self.stdout.write(self.style.SUCCESS(str(report).capitalize() + "."))
