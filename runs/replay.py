"""May this run be replayed now? One answer for every door (API, admin, commands).

`decide()` is pure: given a run and the facts about it (its replays, whether its stored input
is still there), it returns the decision without touching anything. `gather_facts()` reads
those facts; `decide()` gathers them itself when it is not handed any.

The rows of the table are checked in a fixed order and the first that applies answers:
run_in_flight, replay_in_flight, input_gone (nobody can fix these by forcing, so they come
first), then — without force — run_succeeded, already_replayed, tools_called, tools_unknown.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from runs.models import IN_FLIGHT, AgentRun, RunStatus
from runs.refusals import (
    AlreadyReplayed,
    InputGone,
    ReplayInFlight,
    ReplayRefused,
    RunInFlight,
    RunSucceeded,
    ToolsCalled,
    ToolsUnknown,
)


@dataclass(frozen=True)
class ReplaySummary:
    run_id: uuid.UUID
    status: str
    created_at: datetime | None = None


@dataclass(frozen=True)
class ReplayFacts:
    """What decide() needs beyond the row itself."""

    replays: tuple[ReplaySummary, ...] = ()
    input_present: bool = True


@dataclass(frozen=True)
class Decision:
    """The answer for one run: allowed, or the refusal that applies.

    `overridden` is the refusal that force set aside (None when no force was needed), so a door
    can say what it is overriding.
    """

    force: bool
    refusal: ReplayRefused | None = None
    overridden: ReplayRefused | None = field(default=None)

    @property
    def allowed(self) -> bool:
        return self.refusal is None

    @property
    def status(self) -> int:
        return 202 if self.refusal is None else self.refusal.status

    @property
    def code(self) -> str:
        return "replayable" if self.refusal is None else self.refusal.code

    def as_dict(self) -> dict:
        """The decision as the API shows it: `status` is the HTTP status a replay request would get."""
        if self.refusal is None:
            return {"allowed": True, "status": 202, "code": self.code, "detail": "A replay would start now."}
        body = self.refusal.as_dict()
        # A refusal's context may name the run's own status; it must not take the place of the HTTP status.
        if "status" in body:
            body["run_status"] = body.pop("status")
        return {**body, "allowed": False, "status": self.refusal.status}


def tool_names_once(tools: list[str] | None) -> list[str]:
    """Each tool once, in the order it was first called."""
    return list(dict.fromkeys(tools or []))


def decide(run: AgentRun, *, force: bool, facts: ReplayFacts | None = None) -> Decision:
    if facts is None:
        facts = gather_facts(run)

    if run.status in IN_FLIGHT:
        return Decision(
            force,
            RunInFlight(
                f"This run is still {run.status}: a replay now could do its work twice. "
                "Cancel it or wait for it to finish.",
                status=run.status,
            ),
        )
    in_flight = next((r for r in facts.replays if r.status in IN_FLIGHT), None)
    if in_flight is not None:
        return Decision(
            force,
            ReplayInFlight(
                f"This run's replay {in_flight.run_id} is still {in_flight.status}: wait for it to "
                "finish (or cancel it) before replaying the run again.",
                replay_run_id=str(in_flight.run_id),
                replay_status=in_flight.status,
            ),
        )
    if run.input_file and not facts.input_present:
        return Decision(
            force,
            InputGone(
                f"The stored copy of this run's input file “{run.input_file_name}” is gone from disk "
                "(or no longer matches what the run was given), so the run cannot be repeated with "
                "the same input, even by force. Start a new run with the file instead.",
                input_file_name=run.input_file_name,
            ),
        )

    refusal = _refusal_without_force(run, facts)
    if refusal is None:
        return Decision(force)
    if force and refusal.forceable:
        return Decision(force, overridden=refusal)
    return Decision(force, refusal)


def _refusal_without_force(run: AgentRun, facts: ReplayFacts) -> ReplayRefused | None:
    if run.status == RunStatus.SUCCESS:
        return RunSucceeded("This run succeeded: a replay would do all of its work again.")
    succeeded = next((r for r in facts.replays if r.status == RunStatus.SUCCESS), None)
    if succeeded is not None:
        return AlreadyReplayed(f"This run was already replayed successfully by run {succeeded.run_id}.",
            replay_run_id=str(succeeded.run_id),
        )
    tools = tool_names_once(run.tools_executed)
    if tools:
        return ToolsCalled(f"This run already called {', '.join(tools)} before failing: a replay would call "
            "them again.",
            tools=tools,
        )
    if run.tools_executed is None:
        return ToolsUnknown("It is unknown whether this run called any tool before failing, so a replay "
            "could repeat a side effect.",
        )
    return None


# --- Facts ---------------------------------------------------------------------------------------


def input_file_present(run: AgentRun, *, verify_digest: bool = False) -> bool:
    """Is the stored copy still there, the same size (and, if asked, the same bytes)?"""
    if not run.input_file:
        return True
    path = Path(run.input_file)
    try:
        if not path.is_file():
            return False
        if run.input_file_size is not None and path.stat().st_size != run.input_file_size:
            return False
        if verify_digest and run.input_file_sha256:
            digest = hashlib.sha256()
            with path.open("rb") as handle:
                while chunk := handle.read(1024 * 1024):
                    digest.update(chunk)
            return digest.hexdigest() == run.input_file_sha256
    except OSError:
        return False
    return True


def gather_facts(run: AgentRun, *, verify_digest: bool = False) -> ReplayFacts:
    replays = tuple(
        ReplaySummary(run_id, status, created_at)
        for run_id, status, created_at in AgentRun.objects.filter(replay_of_id=run.run_id)
        .order_by("-created_at")
        .values_list("run_id", "status", "created_at")
    )
    return ReplayFacts(replays=replays, input_present=input_file_present(run, verify_digest=verify_digest))


def describe_now(run: AgentRun, *, facts: ReplayFacts | None = None) -> dict:
    """What a replay would do now, without and with force (for the run page and the API)."""
    facts = facts if facts is not None else gather_facts(run)
    plain = decide(run, force=False, facts=facts)
    forced = decide(run, force=True, facts=facts)
    return {**plain.as_dict(), "force_would_replay": forced.allowed}
