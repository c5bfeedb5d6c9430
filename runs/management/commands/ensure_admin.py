import os
import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create the superuser `admin` if it does not exist (password from ADMIN_PASSWORD, else generated)."

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin")

    def handle(self, *args, **options):
        User = get_user_model()
        username = options["username"]
        if User.objects.filter(username=username).exists():
            self.stdout.write(f"Superuser {username!r} already exists; its password is unchanged.")
            return
        password = os.environ.get("ADMIN_PASSWORD") or secrets.token_urlsafe(12)
        User.objects.create_superuser(username=username, email=f"{username}@localhost", password=password)
        if os.environ.get("ADMIN_PASSWORD"):
            self.stdout.write(f"Created superuser {username!r} with the password from ADMIN_PASSWORD.")
        else:
            self.stdout.write(self.style.WARNING(f"Created superuser {username!r} with password: {password}"))
            self.stdout.write("Keep it: it is shown only this once (set ADMIN_PASSWORD to choose your own).")
