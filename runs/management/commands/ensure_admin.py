import os
import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = (
        "Create the superuser `admin` if it does not exist (password from ADMIN_PASSWORD, else generated); "
        "--reset-password gives an existing one a new password (a lost one cannot be read back)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin")
        parser.add_argument("--reset-password", action="store_true",
                            help="set a new password (ADMIN_PASSWORD, else generated and printed once)")

    def handle(self, *args, **options):
        User = get_user_model()
        username = options["username"]
        user = User.objects.filter(username=username).first()
        if user is not None and options["reset_password"]:
            password = os.environ.get("ADMIN_PASSWORD") or secrets.token_urlsafe(12)
            user.set_password(password)
            user.save(update_fields=["password"])
            if os.environ.get("ADMIN_PASSWORD"):
                self.stdout.write(f"The password of {username!r} is now the one in ADMIN_PASSWORD.")
            else:
                self.stdout.write(self.style.WARNING(f"New password for {username!r}: {password}"))
                self.stdout.write("Keep it: it is shown only this once.")
            return
        if user is not None:
            self.stdout.write(
                f"Superuser {username!r} already exists; its password is unchanged "
                "(a lost one: python manage.py ensure_admin --reset-password)."
            )
            return
        password = os.environ.get("ADMIN_PASSWORD") or secrets.token_urlsafe(12)
        User.objects.create_superuser(username=username, email=f"{username}@localhost", password=password)
        if os.environ.get("ADMIN_PASSWORD"):
            self.stdout.write(f"Created superuser {username!r} with the password from ADMIN_PASSWORD.")
        else:
            self.stdout.write(self.style.WARNING(f"Created superuser {username!r} with password: {password}"))
            self.stdout.write("Keep it: it is shown only this once (set ADMIN_PASSWORD to choose your own).")
