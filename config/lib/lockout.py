"""Admin logins locked out per username and address, and per address (django-axes).

django-axes counts failures per combination of `AXES_LOCKOUT_PARAMETERS` and compares the largest
count with one limit. Two limits are wanted: a few failures for one username from one address
(someone guessing a password, LOGIN_FAILURE_LIMIT), and more for one address over any usernames
(one password sprayed over many accounts, LOGIN_ADDRESS_FAILURE_LIMIT). The address's count is
always the largest, so the limit axes compares it with is chosen from both counts: the address
is locked out once its own limit is reached, or for as long as the pair's is. Axes imports this
module by its path (AXES_FAILURE_LIMIT) once the apps are ready.
"""

from __future__ import annotations

from axes.handlers.database import AxesDatabaseHandler
from django.conf import settings
from django.db.models import Sum


def _failures(attempts) -> int:
    return attempts.aggregate(total=Sum("failures_since_start"))["total"] or 0


def failure_limit(request, credentials) -> int:
    """AXES_FAILURE_LIMIT as a callable: axes locks out when the address's failures reach this."""
    # In the order of AXES_LOCKOUT_PARAMETERS: [["username", "ip_address"], "ip_address"].
    pair_attempts, address_attempts = AxesDatabaseHandler().get_user_attempts(request, credentials)
    address_limit = settings.LOGIN_ADDRESS_FAILURE_LIMIT
    if _failures(pair_attempts) >= settings.LOGIN_FAILURE_LIMIT:
        return min(_failures(address_attempts), address_limit)
    return address_limit
