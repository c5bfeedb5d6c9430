"""Workflow steps as `RunStep` rows: step_start, step_complete, step_error (and cancelled).

The recorder is handed to `agents.workflows.compile_workflow`; each step calls it from the
agent loop, and the writes run on the ORM thread like the rest of the run's bookkeeping.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from asgiref.sync import sync_to_async
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from google.genai import types

from agents.workflows import original_error
from runs.ledger import leases
from runs.ledger.journal import SUMMARY_MAX_CHARS, summarize
from runs.models.ledger import RunStep, StepStatus

CANCELLED_WITH_RUN = "Stopped when the run ended, before this step finished."


def output_text(output: Any) -> str:
    if output is None:
        return ""
    if isinstance(output, str):
        return output
    if isinstance(output, types.Content):
        return "".join(part.text or "" for part in output.parts or [])
    try:
        return json.dumps(output, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return str(output)


def _summary(output: Any) -> str:
    text = output_text(output)
    return text if len(text) <= SUMMARY_MAX_CHARS else summarize(text)


def step_started(
    *, run_id: uuid.UUID, seq: int, node_path: str, step_name: str, kind: str, target: str,
    lease: uuid.UUID | None = None,
) -> None:
    with transaction.atomic():
        leases.hold(run_id=run_id, lease=lease, what="a workflow step")
        RunStep.objects.create(
            run_id=run_id, seq=seq, node_path=node_path, step_name=step_name, kind=kind, target=target
        )


def _held_steps(*, run_id: uuid.UUID, lease: uuid.UUID | None, **filters: Any):
    steps = RunStep.objects.filter(run_id=run_id, **filters)
    # The lease check rides in the write's own statement (runs.ledger.leases).
    return steps.filter(leases.held_q(run_id=run_id, lease=lease)) if lease is not None else steps


def _refuse_if_lost(*, run_id: uuid.UUID, lease: uuid.UUID | None) -> None:
    if lease is not None and not leases.held(run_id=run_id, lease=lease).exists():
        raise leases.refuse(run_id=run_id, what="a workflow step")


def step_restarted(*, run_id: uuid.UUID, node_path: str, lease: uuid.UUID | None = None) -> None:
    """The step's retry policy runs it again under the same node path."""
    if not _held_steps(run_id=run_id, lease=lease, node_path=node_path).update(
        attempts=F("attempts") + 1, status=StepStatus.RUNNING, finished_at=None
    ):
        _refuse_if_lost(run_id=run_id, lease=lease)


def step_ended(
    *, run_id: uuid.UUID, node_path: str, status: str, output: Any = None, error: str = "",
    lease: uuid.UUID | None = None,
) -> None:
    fields: dict[str, Any] = {"status": status, "finished_at": timezone.now()}
    if status == StepStatus.SUCCESS:
        fields["output_summary"] = _summary(output)
    if error:
        fields["error"] = error
    if not _held_steps(run_id=run_id, lease=lease, node_path=node_path, status=StepStatus.RUNNING).update(**fields):
        _refuse_if_lost(run_id=run_id, lease=lease)


def settle_unfinished_steps(*, run_id: uuid.UUID) -> int:
    """Steps still running when their run settles were stopped with it."""
    return RunStep.objects.filter(run_id=run_id, status=StepStatus.RUNNING).update(
        status=StepStatus.CANCELLED, finished_at=timezone.now(), error=CANCELLED_WITH_RUN
    )


class RunStepRecorder:
    """The `StepRecorder` of one run; remembers the workflow's output and the first failure."""

    def __init__(self, run_id: uuid.UUID, *, lease: uuid.UUID | None = None):
        self.run_id = run_id
        self.lease = lease
        self.final_output: Any = None
        self.first_failure: tuple[str, BaseException] | None = None
        # One worker executes a run (the claim sees to that), so its steps are numbered here,
        # in the order they start: one INSERT per step_start, no read first.
        self._seq: dict[str, int] = {}

    async def started(self, *, node_path: str, step_name: str, kind: str, target: str) -> None:
        if node_path in self._seq:
            await sync_to_async(step_restarted)(run_id=self.run_id, node_path=node_path, lease=self.lease)
            return
        self._seq[node_path] = seq = len(self._seq) + 1
        await sync_to_async(step_started)(
            run_id=self.run_id, seq=seq, node_path=node_path, step_name=step_name, kind=kind, target=target,
            lease=self.lease,
        )

    async def finished(self, *, node_path: str, output: Any, terminal: bool) -> None:
        if terminal:
            self.final_output = output
        await sync_to_async(step_ended)(
            run_id=self.run_id, node_path=node_path, status=StepStatus.SUCCESS, output=output, lease=self.lease
        )

    async def failed(self, *, node_path: str, error: BaseException) -> None:

        error = original_error(error)
        if self.first_failure is None:
            self.first_failure = (node_path, error)
        await sync_to_async(step_ended)(
            run_id=self.run_id, node_path=node_path, status=StepStatus.ERROR, error=f"{type(error).__name__}: {error}",
            lease=self.lease,
        )

    async def cancelled(self, *, node_path: str) -> None:
        await sync_to_async(step_ended)(
            run_id=self.run_id, node_path=node_path, status=StepStatus.CANCELLED, error="Cancelled while running.",
            lease=self.lease,
        )
