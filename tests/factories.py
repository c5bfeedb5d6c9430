"""Runs in a given state, written without executing anything (fast rule and door tests)."""

from __future__ import annotations

import io
from pathlib import Path

from runs.models.ledger import AgentRun, RunStatus, ToolCall, ToolCallStatus
from runs.services import run as services

TOOLS_UNKNOWN_API = (
    "It is unknown whether this run called any tool before failing, so a replay could repeat a side "
    "effect. Pass force=true to run it again anyway."
)
TOOLS_CALLED_API = (
    "This run already called send_email, update_crm before failing: a replay would call them again. "
    "Pass force=true to run it again anyway."
)
API_HINT = "Pass force=true to run it again anyway."
ADMIN_HINT = "Use “Force replay…” to run it again anyway."


def make_run(
    *, status: str = RunStatus.ERROR, tools=None, created_by=None, owner_id=None, file: bytes | None = None, **fields
):
    """A system run for the end user jane; a person's run is for their own username unless told otherwise."""
    run = services.start_run(
        agent_name="support",
        message="Jane asks about her refund.",
        owner_id=owner_id or ("jane" if created_by is None else created_by.get_username()),
        created_by=created_by,
        file=io.BytesIO(file) if file is not None else None,
        file_name="invoice.txt" if file is not None else None,
        enqueue=False,
    )
    AgentRun.objects.filter(pk=run.pk).update(status=status, tools_executed=tools, **fields)
    run.refresh_from_db()
    return run


# Every row of the replay table: (state, code without force, status, code with force, status).
TABLE = [
    ("queued", "run_in_flight", 409, "run_in_flight", 409),
    ("running", "run_in_flight", 409, "run_in_flight", 409),
    ("success", "run_succeeded", 409, None, 202),
    ("error_no_tools", None, 202, None, 202),
    ("cancelled_no_tools", None, 202, None, 202),
    ("error_tools", "tools_called", 409, None, 202),
    ("error_unknown", "tools_unknown", 409, None, 202),
    # §12.2: every recorded call read only → replayed without force; an unanswered call that acts → in doubt.
    ("error_read_only", None, 202, None, 202),
    ("error_in_doubt", "calls_in_doubt", 409, None, 202),
    ("replay_in_flight", "replay_in_flight", 409, "replay_in_flight", 409),
    ("already_replayed", "already_replayed", 409, None, 202),
    ("input_gone", "input_gone", 410, "input_gone", 410),
]


def run_in_state(state: str, *, created_by=None) -> AgentRun:
    """The original run for one row of TABLE."""
    simple = {
        "queued": (RunStatus.QUEUED, None),
        "running": (RunStatus.RUNNING, None),
        "success": (RunStatus.SUCCESS, ["send_email"]),
        "error_no_tools": (RunStatus.ERROR, []),
        "cancelled_no_tools": (RunStatus.CANCELLED, []),
        "error_tools": (RunStatus.ERROR, ["send_email", "update_crm", "send_email"]),
        "error_unknown": (RunStatus.ERROR, None),
    }
    if state in simple:
        status, tools = simple[state]
        return make_run(status=status, tools=tools, created_by=created_by)
    if state in {"error_read_only", "error_in_doubt"}:
        calls = [("lookup_customer", "read_only", ToolCallStatus.ANSWERED)]
        if state == "error_in_doubt":
            calls.append(("send_email", "idempotent", ToolCallStatus.CALLED))
        return with_journal(make_run(status=RunStatus.ERROR, created_by=created_by), calls)
    if state in {"replay_in_flight", "already_replayed"}:
        original = make_run(status=RunStatus.ERROR, tools=[], created_by=created_by)
        replay = make_run(
            status=RunStatus.RUNNING if state == "replay_in_flight" else RunStatus.SUCCESS,
            tools=[],
            created_by=created_by,
        )
        AgentRun.objects.filter(pk=replay.pk).update(replay_of=original)
        original.replay_id = replay.run_id  # for assertions
        return original
    if state == "input_gone":
        original = make_run(status=RunStatus.ERROR, tools=[], created_by=created_by, file=b"invoice 42")
        Path(original.input_file).unlink()
        return original
    raise ValueError(state)


def with_journal(run: AgentRun, calls: list[tuple[str, str, str]]) -> AgentRun:
    """The run's tool journal as (tool, effect class at call time, status); tools_executed follows it."""
    for seq, (tool, effect, status) in enumerate(calls, start=1):
        ToolCall.objects.create(run=run, seq=seq, call_id=f"call-{seq}", tool_name=tool, effect=effect, status=status)
    AgentRun.objects.filter(pk=run.pk).update(tools_executed=[tool for tool, _, _ in calls])
    run.refresh_from_db()
    return run
