"""The replay/resume chain: the runs a run continues (up its `replay_of` / `resume_of` links) and
the runs that continue it. One walker and one successor query for the intent id, the resume's
session chain, remembering a resume's predecessors, the run page's family and the rules' facts.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q

from runs.models.ledger import AgentRun

# Far beyond any real chain; a bound, so that a corrupted link can never loop.
MAX_CHAIN_RUNS = 1000

RESUME, REPLAY = "resume", "replay"
# Which links to follow up: both (the intent chain), or only the resumes (one session) or replays.
REPLAYS_AND_RESUMES = ("replay_of_id", "resume_of_id")
RESUMES = ("resume_of_id",)
REPLAYS = ("replay_of_id",)


def predecessors(
    run: AgentRun,
    *,
    via: tuple[str, ...] = REPLAYS_AND_RESUMES,
    until: Callable[[AgentRun], bool] | None = None,
    fields: tuple[str, ...] = (),
    limit: int = MAX_CHAIN_RUNS,
) -> Iterator[AgentRun]:
    """The runs `run` continues, nearest first, following the links named in `via`.

    The walk stops at a run for which `until` is true (that run is not left: its own predecessors
    are not yielded), at the root, or after `limit` runs. `fields` loads only those columns.
    """
    current = run
    rows = AgentRun.objects.only(*fields) if fields else AgentRun.objects.all()
    for _ in range(limit):
        if until is not None and until(current):
            return
        parent_id = next((getattr(current, link) for link in via if getattr(current, link) is not None), None)
        if parent_id is None:
            return
        parent = rows.filter(pk=parent_id).first()
        if parent is None:
            return
        current = parent
        yield current


def root_of(run: AgentRun, **walk) -> AgentRun:
    """The last run of `predecessors(run, **walk)`, or `run` itself."""
    root = run
    for root in predecessors(run, **walk):  # noqa: B007 - the last one is wanted
        pass
    return root


@dataclass(frozen=True)
class Successor:
    """A run that replays or resumes another."""

    run_id: uuid.UUID
    status: str
    kind: str = REPLAY
    created_at: datetime | None = None


def successors(run: AgentRun) -> tuple[Successor, ...]:
    """The runs that replay or resume `run`, newest first (one query)."""
    return tuple(
        Successor(run_id, status, RESUME if resume_of_id == run.run_id else REPLAY, created_at)
        for run_id, status, resume_of_id, created_at in AgentRun.objects.filter(
            Q(replay_of_id=run.run_id) | Q(resume_of_id=run.run_id)
        )
        .order_by("-created_at")
        .values_list("run_id", "status", "resume_of_id", "created_at")
    )


def descendants(run: AgentRun, *, limit: int = MAX_CHAIN_RUNS) -> tuple[Successor, ...]:
    """Every run that continues `run`, however far down (a replay of its resume…), newest first.

    Each carries the kind of the link that leaves `run` (its branch's first step), so a chain is
    judged by how it ended: a root whose resume failed and whose resume's resume succeeded was
    finished by its resume. One query per level, bounded by `limit`.
    """
    found: list[Successor] = []
    level = {run.run_id: None}
    while level and len(found) < limit:
        rows = list(
            AgentRun.objects.filter(Q(replay_of_id__in=list(level)) | Q(resume_of_id__in=list(level)))
            .values_list("run_id", "status", "replay_of_id", "resume_of_id", "created_at")[: limit - len(found)]
        )
        next_level = {}
        for run_id, status, replay_of_id, resume_of_id, created_at in rows:
            parent = resume_of_id if resume_of_id in level else replay_of_id
            kind = level[parent] or (RESUME if resume_of_id == run.run_id else REPLAY)
            found.append(Successor(run_id, status, kind, created_at))
            next_level[run_id] = kind
        level = next_level
    return tuple(sorted(found, key=lambda successor: successor.created_at, reverse=True))
