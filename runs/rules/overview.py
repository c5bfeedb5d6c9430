"""The desk at a glance: what needs a person now, counted with set-based, index-backed queries.

Every count is capped (`CAP`, like the run list's paginator): past it the desk says "10,000+",
because an exact COUNT(*) over millions of rows is what makes a page slow. Each set here has a
matching choice of the run list's "desk" filter (`DESK_SETS`), so a count's link lands on
exactly the rows it counted.

"Awaiting a decision" is `runs.rules.replay.decide` applied to whole sets: a failed or cancelled run
with no replay in flight and none that succeeded, which the rules refuse without force because a
call is in doubt (`calls_in_doubt`), it called tools that may act again (`tools_called`) or
nobody knows (`tools_unknown`). A run whose calls were all read-only is not here: it is replayed
without asking. The other refusals cannot
apply to such a run, except `input_gone`, which needs a look at the disk per run and is left to
the run page.

A crash counts once among what needs a person: a run that died and that recovery left for a
person is counted under "died and waiting for a person", and not again under "awaiting a
decision" (its refusal is on its page). The calls in doubt and the runs reconciled in the last
24 h are the work and the history behind those tiles, not more runs to act on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta

from django.core.exceptions import EmptyResultSet
from django.db import connections, transaction
from django.db.models import Count, Exists, OuterRef, Q, QuerySet
from django.db.models.expressions import RawSQL
from django.db.models.functions import TruncHour
from django.utils import timezone

from runs.ledger.reconcile import RECONCILED
from runs.models.approvals import PendingCall
from runs.models.effects import EffectStatus, ToolEffect
from runs.models.inbox import EventStatus, WebhookEvent
from runs.models.ledger import (
    IN_FLIGHT,
    SETTLED,
    UNSETTLED,
    AgentRun,
    Recovery,
    RunStatus,
    SettledOutcome,
    ToolCall,
    ToolCallStatus,
)
from runs.models.schedules import FiringOutcome, RunSchedule, ScheduleFiring
from runs.refusals import CallsInDoubt, ToolsCalled, ToolsUnknown
from runs.rules.replay import READ_ONLY

CAP = 10_000
RECENT = timedelta(hours=24)
CHART_DAYS = 7
FAILED = (RunStatus.ERROR, RunStatus.CANCELLED)
INBOX_TILES = (EventStatus.NEEDS_REVIEW, EventStatus.DEAD)


@dataclass(frozen=True)
class CappedCount:
    value: int
    capped: bool

    def __str__(self) -> str:
        return f"{self.value:,}+" if self.capped else f"{self.value:,}"


def capped_count(queryset: QuerySet, *, cap: int = CAP) -> CappedCount:
    """At most `cap` + 1 primary keys, unordered: the cost is bounded whatever the table's size."""
    return capped_counts({"n": queryset}, cap=cap)["n"]


def capped_counts(querysets: dict[str, QuerySet], *, cap: int = CAP) -> dict[str, CappedCount]:
    """Several capped counts in one statement, one round trip: each is its own scalar subquery
    (`SELECT COUNT(*) FROM (… LIMIT cap + 1)`), so each keeps its own plan and its own index; a
    single scan with COUNT(*) FILTER (…) would read the union of their rows and could not stop
    at the cap."""
    if not querysets:
        return {}
    using = next(iter(querysets.values())).db
    parts, params = [], []
    for queryset in querysets.values():
        limited = queryset.order_by().values("pk")[: cap + 1]
        try:
            sql, sql_params = limited.query.get_compiler(using=using).as_sql()
        except EmptyResultSet:  # a filter that can match nothing (`pk__in=[]`, `.none()`)
            parts.append("0")
            continue
        parts.append(f"(SELECT COUNT(*) FROM ({sql}) AS capped)")
        params.extend(sql_params)
    statement = "SELECT " + ", ".join(parts)
    connection = connections[using]
    if connection.vendor == "postgresql":
        # The sum of the subqueries' estimates passes jit_above_cost, and compiling the statement
        # took seconds on a loaded machine for tens of milliseconds of execution. SET LOCAL ends
        # with the transaction: in autocommit, this block's own.
        with transaction.atomic(using=using), connection.cursor() as cursor:
            cursor.execute("SET LOCAL jit = off")
            cursor.execute(statement, params)
            counted = cursor.fetchone()
    else:
        with connection.cursor() as cursor:
            cursor.execute(statement, params)
            counted = cursor.fetchone()
    return {name: CappedCount(min(n, cap), n > cap) for name, n in zip(querysets, counted, strict=True)}


# --- The sets, each also a choice of the run list's desk filter ------------------------------------


def awaiting_decision(queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    """Failed or cancelled, no replay or resume in flight, none that succeeded: a person must decide."""
    return _undecided(queryset.filter(status__in=FAILED))


# Recovery's verdicts on a run that died which leave it to a person.
LEFT_FOR_A_PERSON = (Recovery.NEEDS_PERSON, Recovery.EXHAUSTED)


def _not_died_for_a_person(queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    """Without the runs `died_waiting_for_a_person` counts: a crash counts once on the desk."""
    return queryset.exclude(recovery__in=LEFT_FOR_A_PERSON)


def _undecided(failed: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    """`awaiting_decision` for runs already filtered to FAILED: none of the runs that continue it,
    however far down its chain (`runs.ledger.chain.descendants`, as the replay rules read it), is in
    flight or succeeded. The status test is written once: PostgreSQL multiplies the selectivities
    of a repeated `status IN (…)`, and the estimate that came out (a fifth of the real rows) made
    it prefer a bitmap scan of every failure to the partial indexes below."""
    return failed.exclude(pk__in=RawSQL(_CONTINUED_FOR_GOOD, [*UNSETTLED, RunStatus.SUCCESS]))


# The runs a continuation in flight or succeeded continues, up the chain: started from the few
# continuation rows (replay_of / resume_of set), walked up by primary key.
_CONTINUED_FOR_GOOD = (
    "WITH RECURSIVE up(run_id) AS ("
    " SELECT COALESCE(resume_of_id, replay_of_id) FROM agent_runs"
    " WHERE (resume_of_id IS NOT NULL OR replay_of_id IS NOT NULL) AND status IN (%s, %s, %s, %s)"
    " UNION"
    " SELECT COALESCE(r.resume_of_id, r.replay_of_id) FROM agent_runs r JOIN up ON r.run_id = up.run_id"
    " WHERE r.resume_of_id IS NOT NULL OR r.replay_of_id IS NOT NULL"
    ") SELECT run_id FROM up"
)


def _unanswered_calls() -> QuerySet[ToolCall]:
    """Calls never answered that no person settled (the partial index toolcall_unsettled_called)."""
    return ToolCall.objects.filter(status=ToolCallStatus.CALLED, settled_outcome="").exclude(effect=READ_ONLY)


def _calls_of_unfinished_records() -> QuerySet[ToolCall]:
    """Answered (or failed) calls whose effect record never finished: a tool that raised may have
    acted first. Driven from the few `started` records (the partial index tooleffect_started_call)."""
    unfinished_record = ToolEffect.objects.filter(
        key=OuterRef("effect_key"), first_run=OuterRef("run"), first_call_id=OuterRef("call_id"),
        status=EffectStatus.STARTED,
    )
    return (
        ToolCall.objects.filter(settled_outcome="")
        .exclude(effect=READ_ONLY)
        .exclude(status=ToolCallStatus.CALLED)
        .filter(Exists(unfinished_record))
    )


# `runs.rules.replay.CallFact.in_doubt` for a non-read-only tool, as two disjoint sets, each with its
# own small partial index. One `IN (… UNION ALL …)` lets PostgreSQL start from them and join to
# the runs by primary key; an `OR` of the two conditions made it walk every candidate run instead.
def _in_doubt_call_ids() -> QuerySet:
    return _unanswered_calls().order_by().values("pk").union(
        _calls_of_unfinished_records().order_by().values("pk"), all=True
    )


def _runs_with_a_call_in_doubt() -> QuerySet:
    return _unanswered_calls().order_by().values("run_id").union(
        _calls_of_unfinished_records().order_by().values("run_id"), all=True
    )


def _calls_that_may_act_again() -> QuerySet[ToolCall]:
    """`runs.rules.replay.CallFact.may_act_again`: not read only, not served or refused, not settled not done."""
    return (
        ToolCall.objects.filter(run=OuterRef("pk"))
        .exclude(effect=READ_ONLY)
        .exclude(status__in=(ToolCallStatus.DEDUPLICATED, ToolCallStatus.REFUSED))
        .exclude(settled_outcome=SettledOutcome.NOT_DONE)
    )


# The base condition is the one of the partial index run_failed_tools_called.
def _called_tools(queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    return _not_died_for_a_person(
        _undecided(queryset.filter(status__in=FAILED, tools_executed__isnull=False).exclude(tools_executed=[]))
    )


def awaiting_calls_in_doubt(queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    return _called_tools(queryset).filter(pk__in=_runs_with_a_call_in_doubt())


def awaiting_tools_called(queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    """Refused `tools_called`: no call in doubt, and a call that may act again (or a journal that
    was unreadable, when `tools_executed` came from the session)."""
    journaled = ToolCall.objects.filter(run=OuterRef("pk"))
    return (
        _called_tools(queryset)
        .exclude(pk__in=_runs_with_a_call_in_doubt())
        .filter(Q(Exists(_calls_that_may_act_again())) | ~Exists(journaled))
    )


# The condition of the partial index run_failed_tools_unknown.
def awaiting_tools_unknown(queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    return _not_died_for_a_person(_undecided(queryset.filter(status__in=FAILED, tools_executed__isnull=True)))


def in_doubt_calls() -> QuerySet[ToolCall]:
    """Calls in doubt (as the replay rules see them) in runs that are over: each needs a person."""
    return ToolCall.objects.filter(run__status__in=SETTLED, pk__in=_in_doubt_call_ids())


def with_calls_in_doubt(queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    return queryset.filter(status__in=SETTLED, pk__in=_runs_with_a_call_in_doubt())


def recently_reconciled(queryset: QuerySet[AgentRun], *, now: datetime | None = None) -> QuerySet[AgentRun]:
    since = (now or timezone.now()) - RECENT
    return queryset.filter(error_code=RECONCILED, finished_at__gte=since)


def recently_recovered(queryset: QuerySet[AgentRun], *, now: datetime | None = None) -> QuerySet[AgentRun]:
    """Runs that died and that the system continued by itself (runs.upkeep.recovery), in the last 24 h."""
    since = (now or timezone.now()) - RECENT
    return queryset.filter(recovery=Recovery.RECOVERED, finished_at__gte=since)


def died_waiting_for_a_person(queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    """Runs that died and that the system left for a person (`recovery_detail` says why), not yet continued."""
    return awaiting_decision(queryset.filter(recovery__in=LEFT_FOR_A_PERSON))


def in_flight(queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    return queryset.filter(status__in=IN_FLIGHT)


def waiting(queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    return queryset.filter(status=RunStatus.WAITING)


def open_pending_calls() -> QuerySet[PendingCall]:
    """Calls that wait for a person's decision or a result now (the partial index on open calls)."""
    return PendingCall.objects.filter(decision="")


def oldest_pending_call() -> PendingCall | None:
    return open_pending_calls().order_by("asked_at").only("run_id", "call_id", "tool_name", "asked_at", "kind").first()


def schedules_skipped_recently(queryset: QuerySet[RunSchedule], *, now: datetime | None = None) -> QuerySet:
    since = (now or timezone.now()) - RECENT
    skipped = ScheduleFiring.objects.filter(
        schedule=OuterRef("pk"), outcome=FiringOutcome.SKIPPED, fired_at__gte=since
    )
    return queryset.filter(Exists(skipped))


# The run list's desk filter: parameter value → (label, the set).
DESK_SETS: dict[str, tuple[str, Callable[[QuerySet[AgentRun]], QuerySet[AgentRun]]]] = {
    CallsInDoubt.code: ("awaiting a decision: calls in doubt", awaiting_calls_in_doubt),
    ToolsCalled.code: ("awaiting a decision: tools called", awaiting_tools_called),
    ToolsUnknown.code: ("awaiting a decision: tools unknown", awaiting_tools_unknown),
    "in_doubt": ("with calls in doubt", with_calls_in_doubt),
    "reconciled_24h": ("reconciled in the last 24 h", recently_reconciled),
    "recovered_24h": ("died, finished by themselves (last 24 h)", recently_recovered),
    "needs_person": ("died, waiting for a person", died_waiting_for_a_person),
    "in_flight": ("in flight (queued or running)", in_flight),
    "waiting": ("waiting for a decision or a result", waiting),
}


# --- The overview ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class InFlight:
    count: CappedCount
    oldest: AgentRun | None


@dataclass(frozen=True)
class Waiting:
    count: CappedCount
    oldest: PendingCall | None


@dataclass(frozen=True)
class Bucket:
    start: datetime
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class Overview:
    awaiting: dict[str, CappedCount]
    calls_in_doubt: CappedCount
    reconciled_24h: CappedCount
    recovered_24h: CappedCount
    died_waiting: CappedCount
    in_flight: InFlight
    approvals_waiting: Waiting
    webhook_events: dict[str, CappedCount] | None
    skipped_firings_24h: CappedCount | None
    hourly: list[Bucket]
    daily: list[Bucket]


def oldest_in_flight() -> AgentRun | None:
    # One row from each in-flight status by the (status, created_at) index, not a sort of both.
    candidates = [
        AgentRun.objects.filter(status=status).order_by("created_at").only("run_id", "status", "created_at",
                                                                        "agent_name", "heartbeat_at").first()
        for status in IN_FLIGHT
    ]
    found = [run for run in candidates if run is not None]
    return min(found, key=lambda run: run.created_at, default=None)


def first_local_day(*, now: datetime, days: int = CHART_DAYS) -> datetime:
    """Local midnight (TIME_ZONE) `days - 1` days before today's: the day chart's first day."""
    today = timezone.localtime(now).date() - timedelta(days=days - 1)
    return timezone.make_aware(datetime.combine(today, time.min))


def runs_per_hour(*, now: datetime, days: int = CHART_DAYS, start: datetime | None = None) -> list[Bucket]:
    """Runs created per hour from `start` (default: the last `days` days) to now's hour, by status;
    one grouped query on the (created_at, status) index, every hour present (empty ones too) so
    the chart has no gaps."""
    end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    start = end - timedelta(days=days) if start is None else start
    rows = (
        AgentRun.objects.filter(created_at__gte=start, created_at__lt=end)
        .annotate(hour=TruncHour("created_at"))
        .values("hour", "status")
        # COUNT(*), not COUNT(run_id): the index holds no run_id, and this keeps the scan index-only.
        .annotate(n=Count("*"))
        .order_by()
    )
    by_hour: dict[datetime, dict[str, int]] = {}
    for row in rows:
        by_hour.setdefault(row["hour"], {})[row["status"]] = row["n"]
    hours = [start + timedelta(hours=i) for i in range(int((end - start).total_seconds() // 3600))]
    return [Bucket(hour, by_hour.get(hour, {})) for hour in hours]


def per_day(hourly: list[Bucket]) -> list[Bucket]:
    """The hours summed by local day (TIME_ZONE), each day labelled by its local midnight: today's
    runs are today's, however far the time zone is from UTC."""
    days: dict[date, Bucket] = {}
    for bucket in hourly:
        local = timezone.localtime(bucket.start)
        day = days.get(local.date())
        if day is None:
            midnight = timezone.make_aware(datetime.combine(local.date(), time.min))
            day = days[local.date()] = Bucket(midnight, {})
        for status, n in bucket.counts.items():
            day.counts[status] = day.counts.get(status, 0) + n
    return list(days.values())


def build_overview(*, now: datetime | None = None, inbox: bool = True, schedules: bool = True) -> Overview:
    """Everything the desk's first page shows; `inbox` and `schedules` follow the viewer's rights."""
    now = now or timezone.now()
    runs = AgentRun.objects.all()
    sets: dict[str, QuerySet] = {
        CallsInDoubt.code: awaiting_calls_in_doubt(runs),
        ToolsCalled.code: awaiting_tools_called(runs),
        ToolsUnknown.code: awaiting_tools_unknown(runs),
        "in_doubt_calls": in_doubt_calls(),
        "reconciled_24h": recently_reconciled(runs, now=now),
        "recovered_24h": recently_recovered(runs, now=now),
        "died_waiting": died_waiting_for_a_person(runs),
        "in_flight": in_flight(runs),
        "approvals_waiting": open_pending_calls(),
    }
    if inbox:
        sets.update({f"events_{status}": WebhookEvent.objects.filter(status=status) for status in INBOX_TILES})
    if schedules:
        sets["skipped_24h"] = ScheduleFiring.objects.filter(outcome=FiringOutcome.SKIPPED, fired_at__gte=now - RECENT)
    counts = capped_counts(sets)
    # From the first local day's midnight: at least 6 × 24 hours, and the last 24 are the hour chart.
    hourly = runs_per_hour(now=now, start=first_local_day(now=now))
    return Overview(
        awaiting={code: counts[code] for code in (CallsInDoubt.code, ToolsCalled.code, ToolsUnknown.code)},
        calls_in_doubt=counts["in_doubt_calls"],
        reconciled_24h=counts["reconciled_24h"],
        recovered_24h=counts["recovered_24h"],
        died_waiting=counts["died_waiting"],
        in_flight=InFlight(counts["in_flight"], oldest_in_flight()),
        approvals_waiting=Waiting(counts["approvals_waiting"], oldest_pending_call()),
        webhook_events={status: counts[f"events_{status}"] for status in INBOX_TILES} if inbox else None,
        skipped_firings_24h=counts["skipped_24h"] if schedules else None,
        hourly=hourly[-24:],
        daily=per_day(hourly),
    )
