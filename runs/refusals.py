"""Typed refusals raised by the run services and translated by every door alike.

Each refusal carries its HTTP status, a stable `code`, the sentence the API says (`detail`),
the sentence the admin says (`admin_detail`, which differs only where it tells a person how to
force) and context for machines (`tools`, `replay_run_id`, …).
"""

from __future__ import annotations

from typing import Any


class Refusal(Exception):
    status: int = 409
    code: str = "refused"

    def __init__(self, detail: str, *, admin_detail: str | None = None, **context: Any):
        super().__init__(detail)
        self.detail = detail
        self.admin_detail = admin_detail if admin_detail is not None else detail
        self.context = {key: value for key, value in context.items() if value is not None}

    def as_dict(self) -> dict[str, Any]:
        """The API's error body: `{"code", "detail", ...context}`."""
        return {"code": self.code, "detail": self.detail, **self.context}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.detail!r})"


class RunNotFound(Refusal):
    """The run does not exist, or the actor may not see it (said the same way on purpose)."""

    status = 404
    code = "not_found"

    def __init__(self, run_id: Any):
        super().__init__(f"There is no run {run_id} that you can see.", run_id=str(run_id))


# --- Replay refusals (DESIGN §5, checked in this order) ---------------------------------------------


class ReplayRefused(Refusal):
    """A refusal of `runs.replay.decide`."""


class RunInFlight(ReplayRefused):
    status = 409
    code = "run_in_flight"


class ReplayInFlight(ReplayRefused):
    status = 409
    code = "replay_in_flight"


class InputGone(ReplayRefused):
    status = 410
    code = "input_gone"


class RunSucceeded(ReplayRefused):
    status = 409
    code = "run_succeeded"


class AlreadyReplayed(ReplayRefused):
    status = 409
    code = "already_replayed"


class ToolsCalled(ReplayRefused):
    status = 409
    code = "tools_called"


class ToolsUnknown(ReplayRefused):
    status = 409
    code = "tools_unknown"


# --- Forcing -------------------------------------------------------------------------------------


class ForceNotPermitted(Refusal):
    status = 403
    code = "force_not_permitted"

    def __init__(self) -> None:
        super().__init__(
            "Forcing a replay needs the permission “Can force a replay that the rules refuse” "
            "(runs.force_replay_agentrun); ask someone who has it."
        )


class ReasonRequired(Refusal):
    status = 400
    code = "reason_required"

    def __init__(self) -> None:
        super().__init__(
            "A forced replay needs a reason: say why running it again is acceptable.",
            admin_detail="Give a reason: say why running these runs again is acceptable.",
        )


class ReasonTooLong(Refusal):
    status = 400
    code = "reason_too_long"

    def __init__(self, limit: int):
        super().__init__(f"The reason is longer than {limit} characters; say it in fewer words.", limit=limit)


# --- Cancellation --------------------------------------------------------------------------------


class RunAlreadySettled(Refusal):
    status = 409
    code = "run_settled"

    def __init__(self, status: str):
        super().__init__(
            f"This run already finished as {status}: there is nothing left to cancel.", status=status
        )
