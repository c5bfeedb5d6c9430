"""The address a login lockout is keyed on: the peer, or the one AXES_PROXY_COUNT proxies vouch for."""

from __future__ import annotations

import pytest
from axes.helpers import get_client_ip_address
from django.test import RequestFactory

from runs.management.commands.serve import web_command


def request(remote: str, forwarded: str | None = None):
    extra = {"REMOTE_ADDR": remote}
    if forwarded is not None:
        extra["HTTP_X_FORWARDED_FOR"] = forwarded
    return RequestFactory().post("/admin/login/", **extra)


def test_without_proxies_a_forwarded_claim_is_ignored(settings):
    settings.AXES_IPWARE_PROXY_COUNT = None
    assert get_client_ip_address(request("203.0.113.9", "198.51.100.1")) == "203.0.113.9"


@pytest.mark.parametrize(("count", "forwarded", "expected"), [
    (1, "198.51.100.7", "198.51.100.7"),
    # A client's own X-Forwarded-For is kept by the proxy, which appends the real peer: the right-most counts.
    (1, "10.9.9.9, 198.51.100.7", "198.51.100.7"),
    (2, "1.2.3.4, 198.51.100.7, 192.0.2.10", "198.51.100.7"),
    (2, "192.0.2.10", "127.0.0.1"),  # fewer hops than proxies: not through them
    (1, "not-an-address", "127.0.0.1"),
])
def test_behind_n_proxies_the_nth_address_from_the_right_is_the_client(settings, count, forwarded, expected):
    settings.AXES_IPWARE_PROXY_COUNT = count
    assert get_client_ip_address(request("127.0.0.1", forwarded)) == expected


def test_the_server_does_not_rewrite_the_peer_from_forwarded_headers():
    assert "--no-proxy-headers" in web_command(host="127.0.0.1", port=8000)
