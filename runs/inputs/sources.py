"""What makes a webhook source's configuration usable: one rule for the admin form, the shell and fixtures.

Pure (no queries) and importing no runs model, so the model's clean() calls it; the signature
schemes the model's field chooses from are defined here with the rule that reads them.
"""

from __future__ import annotations

from typing import Any

from django.db import models

from agents.registry import UnknownAgentError, get_agent_spec, validate_params
from agents.scripted import ScriptError


class SignatureScheme(models.TextChoices):
    """What a provider's signature covers (see runs.inbox.signing)."""

    TIMESTAMPED = "timestamped", "timestamped: a time, the message id and the body"
    BODY = "body", "body only (the message id must be a field of the body)"


MIN_SECRET_CHARS = 16


def source_errors(source: Any) -> dict[str, list[str]]:
    """What is wrong with a source's configuration, by field (empty when it is usable)."""
    errors: dict[str, list[str]] = {}
    spec = None
    try:
        spec = get_agent_spec(source.agent_name)
    except UnknownAgentError as exc:
        errors.setdefault("agent_name", []).append(str(exc))
    header, field = source.message_id_header.strip(), source.message_id_field.strip()
    if bool(header) == bool(field):
        errors.setdefault("message_id_header", []).append(
            "Say where the provider's message id is: a header name or a JSON field path (one of them)."
        )
    if field and any(not part for part in field.split(".")):
        errors.setdefault("message_id_field", []).append(
            "The JSON field path is dotted names, e.g. message.id (no empty parts)."
        )
    scheme = source.signature_scheme
    if scheme not in SignatureScheme.values:
        errors.setdefault("signature_scheme", []).append(
            f"The signature scheme is “timestamped” or “body”, not {scheme!r}."
        )
    elif scheme == SignatureScheme.BODY and header:
        # A body-only signature does not cover a header: the same body could come again under
        # any id, and each new id would be a new event and a new run.
        errors.setdefault("signature_scheme", []).append(
            "A body-only signature does not cover the message id header, so a signed delivery could be "
            "re-sent under a new id: use the timestamped scheme, or take the id from a JSON field of the body."
        )
    if not isinstance(source.params, dict):
        errors.setdefault("params", []).append("params must be a JSON object.")
    elif spec is not None:
        try:
            validate_params(spec, source.params)
        except ScriptError as exc:
            errors.setdefault("params", []).append(str(exc))
    if not source.secret:
        errors.setdefault("secret", []).append("Set the shared secret the provider signs each body with.")
    elif len(source.secret) < MIN_SECRET_CHARS:
        errors.setdefault("secret", []).append(f"The shared secret must be at least {MIN_SECRET_CHARS} characters.")
    if not source.owner_id or not source.owner_id.strip():
        errors.setdefault("owner_id", []).append("Say which end user the runs act for.")
    return errors
