from django.core.management.base import BaseCommand

from runs.inbox.secrets import rotate_webhook_secrets


class Command(BaseCommand):
    help = (
        "Re-encrypt every stored webhook secret under the first key of SECRETS_ENCRYPTION_KEYS. Rotate by "
        "putting a new key first (keeping the old ones after it), running this, then dropping the old keys."
    )

    def handle(self, *args, **options):
        count = rotate_webhook_secrets()
        self.stdout.write(f"Re-encrypted {count} webhook secret(s) under the first key.")
