from django.core.management.base import BaseCommand

from runs.upkeep.periodic_jobs import setup_schedules


class Command(BaseCommand):
    help = "Create or update every periodic job (django-q2 schedules) by name. Safe to run on every deploy."

    def handle(self, *args, **options):
        for name, outcome in setup_schedules().items():
            self.stdout.write(f"{name}: {outcome}")
