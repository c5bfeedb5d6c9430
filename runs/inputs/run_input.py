"""What a run may be started with, for every door: the agent (or workflow), the message, the
owner id, the params and an uploaded file's name. Writes nothing and reads no runs model, so a
model's `clean()` (an owner grant, a schedule) asks the same rules the services ask.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError

from agents.registry import UnknownAgentError, validate_params
from agents.scripted import ScriptError
from agents.services import resolve_runnable
from agents.workflows import WorkflowGraphError, validate_workflow_params
from config.lib import safe_json

MAX_PARAMS_BYTES = 256 * 1024
MAX_OWNER_ID_CHARS = 128
MAX_FILE_NAME_CHARS = 255


def clean_owner_id(owner_id: Any) -> str:
    if not isinstance(owner_id, str) or not owner_id.strip():
        raise ValidationError({"owner_id": "owner_id is required: the end user this run acts for."})
    owner_id = owner_id.strip()
    if len(owner_id) > MAX_OWNER_ID_CHARS:
        raise ValidationError({"owner_id": f"owner_id is longer than {MAX_OWNER_ID_CHARS} characters."})
    if any(unicodedata.category(ch).startswith("C") for ch in owner_id):
        raise ValidationError({"owner_id": "owner_id contains control characters."})
    return owner_id


def _clean_message(message: Any) -> str:
    if not isinstance(message, str) or not message.strip():
        raise ValidationError({"message": "The message is empty: say what the agent should do."})
    if "\x00" in message:
        raise ValidationError({"message": "The message contains a NUL character."})
    if problem := safe_json.text_problem(message):
        raise ValidationError({"message": f"The message {problem}."})
    if len(message) > settings.MAX_MESSAGE_CHARS:
        raise ValidationError(
            {"message": f"The message is {len(message)} characters long; the limit is {settings.MAX_MESSAGE_CHARS}."}
        )
    return message


def _clean_params(params: Any) -> dict:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ValidationError({"params": "params must be a JSON object."})
    try:
        # Every door's params, not only the API's: nothing NaN, too deep, NUL or unencodable is stored.
        safe_json.check_value(params, where="params")
        encoded = json.dumps(params, allow_nan=False)
    except safe_json.UnsafeInput as exc:
        raise ValidationError({"params": str(exc)}) from None
    except (TypeError, ValueError) as exc:
        raise ValidationError({"params": f"params cannot be stored as JSON: {exc}"}) from None
    if len(encoded) > MAX_PARAMS_BYTES:
        raise ValidationError({"params": f"params are {len(encoded)} bytes of JSON; the limit is {MAX_PARAMS_BYTES}."})
    return json.loads(encoded)


def clean_file_name(name: Any) -> str:
    """Refuse any name that could leave the run's directory; never guess a 'fixed' one."""
    if not isinstance(name, str) or not name.strip():
        raise ValidationError({"file": "The uploaded file has no name."})
    name = name.strip()
    if "/" in name or "\\" in name or name in {".", ".."} or ".." in name.split("."):
        raise ValidationError({"file": f"The file name {name!r} contains a path; send a plain file name."})
    if "\x00" in name or any(unicodedata.category(ch) == "Cc" for ch in name):
        raise ValidationError({"file": "The file name contains control characters."})
    # Format characters (bidi overrides such as U+202E, zero-width marks) make a name read as
    # something it is not ("invoice\u202efdp.exe" shows as "invoiceexe.pdf"); surrogates are not text.
    if any(unicodedata.category(ch) in {"Cf", "Cs"} for ch in name):
        raise ValidationError(
            {"file": "The file name contains invisible formatting characters (such as bidi overrides)."}
        )
    if name.startswith("."):
        raise ValidationError({"file": f"The file name {name!r} is hidden (starts with a dot)."})
    if len(name) > MAX_FILE_NAME_CHARS:
        raise ValidationError({"file": f"The file name is longer than {MAX_FILE_NAME_CHARS} characters."})
    return name


def input_errors(
    *, agent_name: Any, message: Any, owner_id: Any, params: Any
) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Clean a run's input: (cleaned, errors). `cleaned["agent"]` is an AgentSpec or a workflow snapshot."""
    errors: dict[str, list[str]] = {}
    cleaned: dict[str, Any] = {}
    for field, clean, value in (
        ("agent", None, agent_name),
        ("message", _clean_message, message),
        ("owner_id", clean_owner_id, owner_id),
        ("params", _clean_params, params),
    ):
        try:
            if clean is None:
                cleaned[field] = resolve_runnable(value if isinstance(value, str) else repr(value))
            else:
                cleaned[field] = clean(value)
        except UnknownAgentError as exc:
            errors.setdefault("agent", []).append(str(exc))
        except ValidationError as exc:
            for key, messages in exc.message_dict.items():
                errors.setdefault(key, []).extend(messages)
        except WorkflowGraphError as exc:
            errors.setdefault("agent", []).extend(exc.problems)
    if "agent" in cleaned and "params" in cleaned:
        target = cleaned["agent"]
        try:
            if isinstance(target, dict):
                validate_workflow_params(target, cleaned["params"], faults_enabled=settings.SCRIPTED_FAULTS_ENABLED)
            else:
                validate_params(target, cleaned["params"])
        except ScriptError as exc:
            errors.setdefault("params", []).append(str(exc))
    return cleaned, errors


def check_run_input(*, agent_name: Any, message: Any, owner_id: Any, params: Any) -> dict[str, Any]:
    """Validate what a run would be started with, writing nothing (e.g. a schedule's input)."""
    cleaned, errors = input_errors(agent_name=agent_name, message=message, owner_id=owner_id, params=params)
    if errors:
        raise ValidationError(errors)
    return cleaned
