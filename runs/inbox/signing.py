"""How a provider proves a delivery is its own, and not an old one sent again: two schemes, one per source.

* **timestamped** (the default): `X-Signature: t=<unix seconds>,v1=<hex>`, the hex digest of
  HMAC-SHA256 with the source's secret over `f"{t}.{message_id}.".encode() + body`. The message id
  is signed wherever it travels (a header or a body field), so a delivery re-sent under a new id
  no longer matches, and `t` bounds how long a captured delivery can be sent at all
  (`WEBHOOK_SIGNATURE_TOLERANCE_SECONDS`, into the past and the future). Several `v1=` values are
  accepted, so a provider can sign with the old and the new secret while it rotates them.
* **body**: `X-Signature: sha256=<hex>`, HMAC-SHA256 of the raw body alone. Allowed only when the
  message id is a field of that body (`runs.inbox.sources`, and a constraint on the table).

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
from runs.models import SignatureScheme, WebhookSource

SIGNATURE_HEADER = "X-Signature"
BODY_PREFIX = "sha256="
TIMESTAMP_KEY = "t"
DIGEST_KEY = "v1"

_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
# Unix seconds, short enough that a hostile value cannot make a huge integer.
_UNIX_SECONDS = re.compile(r"[0-9]{1,11}")


def what_to_sign(source: WebhookSource) -> str:
    """The sentence every signature refusal ends with: exactly what this source expects."""
    if source.signature_scheme == SignatureScheme.BODY:
        return (
            f"this source expects “{SIGNATURE_HEADER}: {BODY_PREFIX}<hex>”, the HMAC-SHA256 of the raw body "
            "with the source's shared secret."
        )
    return (
        f"this source expects “{SIGNATURE_HEADER}: {TIMESTAMP_KEY}=<unix seconds>,{DIGEST_KEY}=<hex>”, the "
        f"HMAC-SHA256 with the source's shared secret of “<t>.<message id>.” followed by the raw body, the "
        f"message id being the one in the {source.message_id_location}."
    )


class SignatureMissing(WebhookRefused):
    status = 401
    code = "signature_missing"

    def __init__(self, source: WebhookSource) -> None:
        super().__init__(
            f"The request has no {SIGNATURE_HEADER} header: {what_to_sign(source)}",
            scheme=source.signature_scheme,
        )


class BadSignature(WebhookRefused):
    status = 401
    code = "bad_signature"

    def __init__(self, source: WebhookSource, problem: str | None = None) -> None:
        problem = problem or (
            f"The {SIGNATURE_HEADER} header does not match this delivery signed with the source's shared secret"
        )
        super().__init__(f"{problem}: {what_to_sign(source)}", scheme=source.signature_scheme)


class SignatureExpired(WebhookRefused):
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
    """Everything about the header that needs neither the body nor the secret: present, well formed, fresh.

    Raises SignatureMissing, BadSignature (malformed) or SignatureExpired.
    """
    if header is None or not header.strip():
        raise SignatureMissing(source)
    header = header.strip()
    if source.signature_scheme == SignatureScheme.BODY:
        return _read_body_header(source, header)
    return _read_timestamped_header(source, header)


def _read_body_header(source: WebhookSource, header: str) -> Signature:
    prefix, digest = header[: len(BODY_PREFIX)], header[len(BODY_PREFIX):]
    if prefix.lower() != BODY_PREFIX:
        raise BadSignature(source, f"The {SIGNATURE_HEADER} header does not start with “{BODY_PREFIX}”")
    digest = digest.strip().lower()
    if not _HEX_DIGEST.fullmatch(digest):
        raise BadSignature(source, f"The {SIGNATURE_HEADER} header's digest is not 64 hexadecimal digits")
    return Signature(digests=(digest,))


def _read_timestamped_header(source: WebhookSource, header: str) -> Signature:
    if header[: len(BODY_PREFIX)].lower() == BODY_PREFIX:
        raise BadSignature(
            source, f"The {SIGNATURE_HEADER} header is a body-only signature ({BODY_PREFIX}…), which this source "
            "does not accept"
        )
    timestamps: list[str] = []
    digests: list[str] = []
    for part in header.split(","):
        if not part.strip():
            continue
        key, equals, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not equals:
            raise BadSignature(source, f"The {SIGNATURE_HEADER} header's part “{part.strip()[:40]}” is not key=value")
        if key == TIMESTAMP_KEY:
            timestamps.append(value)
        elif key == DIGEST_KEY:
            digests.append(value.lower())
        # Other keys (another provider's schemes, a future version) are not ours to judge.
    if len(timestamps) != 1:
        problem = "has no timestamp (t=…)" if not timestamps else "has more than one timestamp (t=…)"
        raise BadSignature(source, f"The {SIGNATURE_HEADER} header {problem}")
    if not _UNIX_SECONDS.fullmatch(timestamps[0]):
        raise BadSignature(source, f"The {SIGNATURE_HEADER} timestamp is not a whole number of unix seconds")
    if not digests:
        raise BadSignature(source, f"The {SIGNATURE_HEADER} header has no digest ({DIGEST_KEY}=…)")
    if not all(_HEX_DIGEST.fullmatch(digest) for digest in digests):
        raise BadSignature(source, f"A {DIGEST_KEY}= digest in the {SIGNATURE_HEADER} header is not 64 hexadecimal digits")
    timestamp = int(timestamps[0])
    now = int(time.time())
    tolerance = settings.WEBHOOK_SIGNATURE_TOLERANCE_SECONDS
    if abs(now - timestamp) > tolerance:
        raise SignatureExpired(timestamp=timestamp, now=now, tolerance=tolerance)
    return Signature(digests=tuple(digests), timestamp=timestamp)


def verify_signature(source: WebhookSource, signature: Signature, body: bytes, *, message_id: str | None) -> None:
    """Raises BadSignature unless one of the digests is this delivery's, signed with the source's secret.

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
        raise BadSignature(source)
