"""Django for the bundled agent packages when ADK's own tools load them (`adk web`, `adk run`).

Their tools read and write Agent Ledger's models (customers, the outbox, CRM notes), so they
need Django set up. Inside Agent Ledger it already is, and this does nothing.
"""

from __future__ import annotations

import os

import django
from django.apps import apps


def setup_django() -> None:
    if apps.ready:
        return
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()
