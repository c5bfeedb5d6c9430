"""What a run's failure tells API users: what happened, never the code's exception or the host.

The ledger keeps the whole story for the support desk (the admin shows the stored message: the
exception's class and text, the worker's host and pid). Through the API an exception's text is
internal detail — class names of the tool's code, paths, a driver's message — and a worker's
`host:pid` names the machine, so API users get a sentence per outcome instead, and the rest of a
message with the worker's identity taken out. Pure: the serializers and the chat stream call it.
"""

from __future__ import annotations

import re

SEE_THE_DESK = "support can read the error on the run's page in the admin."
# The outcomes whose stored message is the exception itself (runs.ledger.outcomes.describe_exception).
EXCEPTION_OUTCOMES = {
    "tool_failed": f"A tool failed while the agent ran; {SEE_THE_DESK}",
    "agent_error": f"The agent failed; {SEE_THE_DESK}",
    "internal": f"The worker could not run the agent; {SEE_THE_DESK}",
    "database_lost": f"The worker lost its connection to the database while the run was in flight; {SEE_THE_DESK}",
}
STEP_FAILED = f"This step failed; {SEE_THE_DESK}"
# "SomeError: text" / "module.SomeError: text": how an exception's class leads a stored message.
_EXCEPTION_PREFIX = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Fault|Failure)\b:")


def public_error_message(*, error_code: str, error_message: str, worker: str) -> str:
    """The run's error message as an API user reads it."""
    if error_code in EXCEPTION_OUTCOMES:
        return EXCEPTION_OUTCOMES[error_code]
    if _EXCEPTION_PREFIX.match(error_message):
        return f"The run failed; {SEE_THE_DESK}"
    if worker:
        error_message = error_message.replace(f" ({worker})", "").replace(worker, "its worker")
    return error_message


# An exception's class stored as an event's error code (ADK's model codes are upper-case words).
_EXCEPTION_CLASS = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Fault|Failure)$")
EVENT_FAILED_CODE = "agent_error"


def public_event_error(*, error_code: str, error_message: str) -> tuple[str, str]:
    """A session event's error as an API user reads it: the words the run page gives for an exception,
    never its class or text (a plugin's or tool's internals); the model's own codes stay as they are."""
    if _EXCEPTION_CLASS.match(error_code or "") or _EXCEPTION_PREFIX.match(error_message or "") or (
        (error_message or "").startswith("Error in plugin")
    ):
        return EVENT_FAILED_CODE, EXCEPTION_OUTCOMES[EVENT_FAILED_CODE]
    return error_code, error_message


def public_step_error(error: str) -> str:
    """A workflow step's error as an API user reads it: an exception's text is the desk's."""
    return STEP_FAILED if _EXCEPTION_PREFIX.match(error) else error
