"""What API users may put in a run's `params`.

A script makes the offline model call any tool with any arguments (an email to anyone, a note on
any contact), so whether users may send one is a deployment's decision: SCRIPTS_FROM_USERS_ALLOWED.
Scripts staff configure (webhook sources, schedules) and the command line are not affected.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

SCRIPT_KEYS = ("script", "scripts")


def scripts_refusal(params: Any) -> str | None:
    """Why these params are refused from an API user, or None."""
    if settings.SCRIPTS_FROM_USERS_ALLOWED or not isinstance(params, dict):
        return None
    given = [key for key in SCRIPT_KEYS if key in params]
    if not given:
        return None
    return (
        f"params.{given[0]} is not accepted from API users here (SCRIPTS_FROM_USERS_ALLOWED is off): "
        "the agent plays its own default script."
    )
