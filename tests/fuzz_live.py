"""The live fuzz run's two halves (`.ci/schemathesis-live`): seeding the database, and the hooks.

`python -m tests.fuzz_live seed` (with the server's settings) makes the seeded runs and workflow
of `tests.fuzz_hooks`, a plain user and a superuser, and prints one fresh API token for each.
As `SCHEMATHESIS_HOOKS=tests.fuzz_live`, it registers the formats and failure filter of
`tests.fuzz_hooks` and prepares each case as the in-process test does, before it is sent.
"""

from __future__ import annotations

import os
import sys

import django
import schemathesis

# The formats read the app's own rules (memory's search words) and seeding writes rows.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django.setup()

from tests.fuzz_hooks import prepare, seed  # noqa: E402 - Django is set up first

# A plain user acts for their own username only; the superuser for anyone.
USERS = {"fuzz-user": False, "fuzz-admin": True}


@schemathesis.hook
def before_call(context, case, **kwargs):
    prepare(case)


def seed_and_print_tokens() -> None:
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    seed()
    tokens = []
    for username, superuser in USERS.items():
        user, _ = get_user_model().objects.get_or_create(
            username=username, defaults={"is_staff": superuser, "is_superuser": superuser}
        )
        # A fresh token each run: one left from an earlier run may have expired (API_TOKEN_TTL_DAYS).
        Token.objects.filter(user=user).delete()
        tokens.append(Token.objects.create(user=user).key)
    print(" ".join(tokens))


if __name__ == "__main__":
    if sys.argv[1:] != ["seed"]:
        sys.exit("usage: python -m tests.fuzz_live seed")
    seed_and_print_tokens()
