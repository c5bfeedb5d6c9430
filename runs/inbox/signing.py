"""How a provider proves a delivery is its own: an HMAC-SHA256 of the raw body with the source's secret.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

from runs.inbox.refusals import WebhookRefused
from runs.models import WebhookSource

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Signature"
SIGNATURE_PREFIX = "sha256="


class SignatureMissing(WebhookRefused):
    status = 401
    code = "signature_missing"

    def __init__(self) -> None:
        super().__init__(
            f"The request has no {SIGNATURE_HEADER} header: sign the raw body with the source's shared "
            f"secret (HMAC-SHA256) and send it as “{SIGNATURE_HEADER}: {SIGNATURE_PREFIX}<hex digest>”."
        )


class BadSignature(WebhookRefused):
    status = 401
    code = "bad_signature"

    def __init__(self, detail: str | None = None) -> None:
        super().__init__(
            detail
            or f"The {SIGNATURE_HEADER} header does not match the body signed with this source's shared "
            "secret (HMAC-SHA256 of the exact bytes sent)."
        )


def sign(secret: str, body: bytes) -> str:
    """The signature header value a provider sends for `body`."""
    return SIGNATURE_PREFIX + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify_signature(source: WebhookSource, body: bytes, header: str | None) -> None:
    if header is None or not header.strip():
        raise SignatureMissing()
    header = header.strip()
    if not header.startswith(SIGNATURE_PREFIX):
        raise BadSignature(
            f"The {SIGNATURE_HEADER} header must read “{SIGNATURE_PREFIX}<hex digest>” (HMAC-SHA256 of the raw body)."
        )
    # Constant time on the bytes: how much of a guess matched never shows in the timing.
    if not hmac.compare_digest(sign(source.secret, body).encode(), header.encode("utf-8", "replace")):
        raise BadSignature()
