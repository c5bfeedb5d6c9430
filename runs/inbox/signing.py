"""How a provider proves a delivery is its own, and not an old one sent again: two schemes, one per source.

* **timestamped** (the default): `X-Signature: t=<unix seconds>,v1=<hex>`, the hex digest of
  HMAC-SHA256 with the source's secret over `f"{t}.{message_id}.".encode() + body`. The message id
  is signed wherever it travels (a header or a body field), so a delivery re-sent under a new id
  no longer matches, and `t` bounds how long a captured delivery can be sent at all
  (`WEBHOOK_SIGNATURE_TOLERANCE_SECONDS`, into the past and the future). Several `v1=` values are
  accepted, so a provider can sign with the old and the new secret while it rotates them.
* **body**: `X-Signature: sha256=<hex>`, HMAC-SHA256 of the raw body alone. Allowed only when the
  message id is a field of that body (`runs.inputs.sources`, and a constraint on the table).

Digests are compared in constant time, whatever their case or surrounding whitespace.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings

from runs.inbox.refusals import WebhookRefused
from runs.inputs.sources import SignatureScheme
from runs.models.inbox import WebhookSource

SIGNATURE_HEADER = "X-Signature"
BODY_PREFIX = "sha256="
TIMESTAMP_KEY = "t"
DIGEST_KEY = "v1"

_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
# Unix seconds, short enough that a hostile value cannot make a huge integer.
_UNIX_SECONDS = re.compile(r"[0-9]{1,11}")


class Unverified(Exception):
    """A delivery whose signature does not verify: missing, malformed or not this delivery's.

    Not a refusal the caller reads: the receipt answers every unverified delivery, and every
    delivery to a source that does not exist, with one refusal (`receipt.NotAccepted`), so an
    unauthenticated caller learns neither which sources exist nor what they sign. The reason is
    for the operator's log.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SignatureExpired(WebhookRefused):
    """Said only to a caller whose digest matched: who can sign for the source may hear about its clock."""

    status = 401
    code = "signature_expired"

    def __init__(self, *, timestamp: int, now: int, tolerance: int) -> None:
        skew = now - timestamp
        when = datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        direction = "old" if skew > 0 else "ahead of this server's clock"
        super().__init__(
            f"The {SIGNATURE_HEADER} timestamp t={timestamp} ({when}) is {abs(skew)} seconds {direction}; a "
            f"signature is accepted within {tolerance} seconds of this server's clock either way "
            "(WEBHOOK_SIGNATURE_TOLERANCE_SECONDS). Sign each delivery, retries included, when it is sent, "
            "and check the sender's clock.",
            timestamp=timestamp,
            tolerance_seconds=tolerance,
        )


# --- Signing (for providers, clients and tests) -----------------------------------------------------


def _digest(secret: str, signed: bytes) -> str:
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def _timestamped_bytes(timestamp: int, message_id: str, body: bytes) -> bytes:
    return f"{timestamp}.{message_id}.".encode() + body


def sign_timestamped(
    secret: str | Sequence[str], body: bytes, *, message_id: str, timestamp: int | None = None
) -> str:
    """The `X-Signature` value of the timestamped scheme; several secrets give one `v1=` each."""
    secrets = [secret] if isinstance(secret, str) else list(secret)
    t = int(time.time()) if timestamp is None else timestamp
    signed = _timestamped_bytes(t, message_id, body)
    return ",".join([f"{TIMESTAMP_KEY}={t}", *(f"{DIGEST_KEY}={_digest(s, signed)}" for s in secrets)])


def sign_body(secret: str, body: bytes) -> str:
    """The `X-Signature` value of the body-only scheme."""
    return BODY_PREFIX + _digest(secret, body)


# --- Verifying --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """A signature header as read: its digests (lowercase hex) and, for the timestamped scheme, its time."""

    digests: tuple[str, ...]
    timestamp: int | None = None


def read_signature(source: WebhookSource, header: str | None) -> Signature:
    """Everything about the header that needs neither the body nor the secret: present and well formed.

    Raises Unverified. Freshness is judged after the digest (`verify_signature`), so that only a
    caller who can sign hears about the clock.
    """
    if header is None or not header.strip():
        raise Unverified(f"no {SIGNATURE_HEADER} header")
    header = header.strip()
    if source.signature_scheme == SignatureScheme.BODY:
        return _read_body_header(source, header)
    return _read_timestamped_header(source, header)


def _read_body_header(source: WebhookSource, header: str) -> Signature:
    prefix, digest = header[: len(BODY_PREFIX)], header[len(BODY_PREFIX):]
    if prefix.lower() != BODY_PREFIX:
        raise Unverified(f"the header does not start with “{BODY_PREFIX}”")
    digest = digest.strip().lower()
    if not _HEX_DIGEST.fullmatch(digest):
        raise Unverified("the header's digest is not 64 hexadecimal digits")
    return Signature(digests=(digest,))


def _read_timestamped_header(source: WebhookSource, header: str) -> Signature:
    if header[: len(BODY_PREFIX)].lower() == BODY_PREFIX:
        raise Unverified(f"the header is a body-only signature ({BODY_PREFIX}…) on a timestamped source")
    timestamps: list[str] = []
    digests: list[str] = []
    for part in header.split(","):
        if not part.strip():
            continue
        key, equals, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not equals:
            raise Unverified(f"the header's part “{part.strip()[:40]}” is not key=value")
        if key == TIMESTAMP_KEY:
            timestamps.append(value)
        elif key == DIGEST_KEY:
            digests.append(value.lower())
        # Other keys (another provider's schemes, a future version) are not ours to judge.
    if len(timestamps) != 1:
        problem = "has no timestamp (t=…)" if not timestamps else "has more than one timestamp (t=…)"
        raise Unverified(f"the header {problem}")
    if not _UNIX_SECONDS.fullmatch(timestamps[0]):
        raise Unverified("the timestamp is not a whole number of unix seconds")
    if not digests:
        raise Unverified(f"the header has no digest ({DIGEST_KEY}=…)")
    if not all(_HEX_DIGEST.fullmatch(digest) for digest in digests):
        raise Unverified(f"a {DIGEST_KEY}= digest is not 64 hexadecimal digits")
    return Signature(digests=tuple(digests), timestamp=int(timestamps[0]))


def verify_signature(source: WebhookSource, signature: Signature, body: bytes, *, message_id: str | None) -> None:
    """Raises Unverified unless one of the digests is this delivery's, signed with the source's secret,
    then SignatureExpired if its time is outside WEBHOOK_SIGNATURE_TOLERANCE_SECONDS.

    `message_id` is the id as the inbox reads it (the timestamped scheme signs it; the body scheme
    signs only the body, which then holds the id).
    """
    if source.signature_scheme == SignatureScheme.BODY:
        signed = body
    else:
        if signature.timestamp is None or message_id is None:
            raise ValueError("The timestamped scheme signs a time and the message id: both are needed.")
        signed = _timestamped_bytes(signature.timestamp, message_id, body)
    expected = _digest(source.secret, signed).encode()
    matched = False
    # Every digest is compared in constant time, with no early exit: neither which one matched nor
    # how much of one did shows in the timing.
    for digest in signature.digests:
        matched |= hmac.compare_digest(expected, digest.encode())
    if not matched:
        raise Unverified("no digest matches this delivery signed with the source's secret")
    if signature.timestamp is not None:
        now = int(time.time())
        tolerance = settings.WEBHOOK_SIGNATURE_TOLERANCE_SECONDS
        if abs(now - signature.timestamp) > tolerance:
            raise SignatureExpired(timestamp=signature.timestamp, now=now, tolerance=tolerance)
