"""The client's address, for keying login lockouts: REMOTE_ADDR, or behind N trusted proxies the
N-th address from the right of X-Forwarded-For (AXES_PROXY_COUNT).

Addresses left of the proxies' own are whatever the client wrote, so only the one the nearest
trusted proxy appended counts. The app's server (uvicorn) runs without proxy headers
(`--no-proxy-headers`), so REMOTE_ADDR is always the TCP peer and never a forwarded claim.
"""

from __future__ import annotations

import ipaddress

from django.conf import settings


def _address(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text.strip().strip("[]")))
    except ValueError:
        return None


def client_ip(request) -> str | None:
    remote = request.META.get("REMOTE_ADDR")
    count = settings.AXES_IPWARE_PROXY_COUNT
    if not count:
        return remote
    forwarded = [part for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if part.strip()]
    if len(forwarded) < count:
        return remote  # not through the expected proxies: the peer is the client
    return _address(forwarded[-count]) or remote
