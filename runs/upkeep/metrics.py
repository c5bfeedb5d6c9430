"""The ledger for Prometheus: gauges read from the database at scrape time, counters of events.

Gauges describe a state (runs in flight, calls in doubt, the queue): they are read from the
database when Prometheus scrapes, so every web process answers the same and none keeps state.
Each read is an index range over a small set (in-flight rows, rows still `called`, the queue,
the last day of runs), never a COUNT over the whole ledger.

Counters count events as they happen in a process (reconciliations, replay refusals, model
retries). prometheus_client keeps them per process; with `PROMETHEUS_MULTIPROC_DIR` set, every
process writes them to files there and a scrape of any process sums them (django-prometheus's
way, followed by `metrics_view`). They restart from zero with the process, which `rate()` and
`increase()` take in their stride.

django-prometheus's middleware adds the request metrics (latency, status codes) beside these.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterator
from datetime import timedelta

import prometheus_client
from django.conf import settings
from django.db.models import Count, Min
from django.http import Http404, HttpRequest, HttpResponse
from django.utils import timezone
from django_prometheus.exports import ExportToDjangoView
from django_q.models import OrmQ, Schedule
from prometheus_client import multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from runs.ledger import lifecycle, presence
from runs.ledger.counters import MODEL_RETRIES, RECONCILIATIONS, REPLAY_REFUSALS, RUNS_CLAIMED  # noqa: F401 - the process's counters, registered
from runs.models.approvals import WaitKind
from runs.models.inbox import EventStatus, WebhookEvent
from runs.models.ledger import IN_FLIGHT, AgentRun, RunStatus
from runs.rules import overview

# Terminal inbox states grow for ever; the gauges report the states a person or a worker acts on.
WATCHED_EVENT_STATES = [
    EventStatus.RECEIVED, EventStatus.PROCESSING, EventStatus.RETRY_WAIT, EventStatus.NEEDS_REVIEW, EventStatus.DEAD,
]
RECENT = timedelta(hours=24)


class LedgerCollector(Collector):
    """The ledger's state, read from the database on every scrape (a handful of indexed queries)."""

    def describe(self) -> list:
        # Registering would otherwise call collect(), i.e. query the database at import time.
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = timezone.now()

        recent = GaugeMetricFamily(
            "agentledger_runs_last_24h", "Runs created in the last 24 hours, by status and trigger.",
            labels=["status", "trigger"],
        )
        for row in (
            AgentRun.objects.filter(created_at__gte=now - RECENT).values("status", "trigger")
            .annotate(n=Count("*")).order_by()  # index-only on (created_at, status, trigger)
        ):
            recent.add_metric([row["status"], row["trigger"]], row["n"])
        yield recent

        flight = GaugeMetricFamily(
            "agentledger_runs_in_flight", "Runs queued or running, by status and worker (empty while queued).",
            labels=["status", "worker"],
        )
        heartbeat = AgentRun.objects.filter(status=RunStatus.RUNNING).aggregate(oldest=Min("heartbeat_at"))["oldest"]
        for row in (
            AgentRun.objects.filter(status__in=IN_FLIGHT).values("status", "worker").annotate(n=Count("pk")).order_by()
        ):
            flight.add_metric([row["status"], row["worker"]], row["n"])
        yield flight

        yield GaugeMetricFamily(
            "agentledger_heartbeat_age_max_seconds",
            "Age of the oldest heartbeat among running runs (0 when none runs); past RUN_STALE_AFTER_SECONDS "
            "the run is reconciled.",
            value=(now - heartbeat).total_seconds() if heartbeat else 0.0,
        )
        waiting = GaugeMetricFamily(
            "agentledger_calls_waiting", "Tool calls waiting for a person's decision (confirmation) or a long-running "
            "result (result), by kind; their runs are `waiting` and hold no worker.", labels=["kind"],
        )
        by_kind = dict(overview.open_pending_calls().values_list("kind").annotate(n=Count("pk")).order_by())
        for kind in WaitKind.values:
            waiting.add_metric([kind], by_kind.get(kind, 0))
        yield waiting
        oldest = overview.oldest_pending_call()
        yield GaugeMetricFamily(
            "agentledger_call_waiting_age_max_seconds",
            "How long the oldest waiting call has waited (0 when none waits); past APPROVAL_TIMEOUT_SECONDS it is "
            "rejected by the system.",
            value=(now - oldest.asked_at).total_seconds() if oldest else 0.0,
        )
        yield GaugeMetricFamily(
            "agentledger_tool_calls_in_doubt", "Tool calls never answered in runs that are over.",
            value=overview.in_doubt_calls().count(),
        )

        events = GaugeMetricFamily(
            "agentledger_webhook_events", "Webhook events by status (the states still needing work or a person).",
            labels=["status"],
        )
        counts = dict(
            WebhookEvent.objects.filter(status__in=WATCHED_EVENT_STATES).values_list("status")
            .annotate(n=Count("pk")).order_by()
        )
        for status in WATCHED_EVENT_STATES:
            events.add_metric([status], counts.get(status, 0))
        yield events

        yield from self.collect_queue(now)

        queue = GaugeMetricFamily(
            "agentledger_queue_depth", "Periodic-job tasks waiting in the django-q2 ORM broker, by queue (runs never "
            "pass through it).", labels=["queue"]
        )
        depth = dict(OrmQ.objects.values_list("key").annotate(n=Count("pk")).order_by())
        queue.add_metric([settings.Q_CLUSTER["name"]], depth.pop(settings.Q_CLUSTER["name"], 0))
        for key, n in depth.items():
            queue.add_metric([key], n)
        yield queue


    @staticmethod
    def collect_queue(now) -> Iterator[GaugeMetricFamily]:
        """The run table as a queue: its depth and age, the claim rate, the workers, the periodic jobs' lag."""
        claimable = lifecycle.claimable_runs()
        oldest = claimable.values_list("created_at", flat=True).first()
        yield GaugeMetricFamily(
            "agentledger_claimable_runs", "Runs queued and claimable by a worker process now.", value=claimable.count(),
        )
        yield GaugeMetricFamily(
            "agentledger_claimable_run_age_max_seconds",
            "How long the oldest claimable run has waited (0 when none waits): high while workers have room means "
            "they are not claiming (down, or not woken).",
            value=(now - oldest).total_seconds() if oldest else 0.0,
        )
        # Claimed recently, found through the created_at index (a run is claimed soon after it is
        # written; a continuation is a new row).
        yield GaugeMetricFamily(
            "agentledger_runs_claimed_last_minute",
            "Runs claimed by workers in the last 60 s, read from the ledger (so every scrape of every process agrees).",
            value=AgentRun.objects.filter(created_at__gte=now - RECENT, started_at__gte=now - timedelta(seconds=60))
            .count(),
        )
        alive = presence.alive_workers()
        if alive is not None:
            yield GaugeMetricFamily(
                "agentledger_worker_processes_alive",
                "runworker processes alive (each holds its advisory lock while its database session lives; PostgreSQL).",
                value=alive,
            )
        due = Schedule.objects.filter(next_run__lt=now).exclude(repeats=0).aggregate(oldest=Min("next_run"))["oldest"]
        yield GaugeMetricFamily(
            "agentledger_periodic_jobs_lag_seconds",
            "How long the most overdue periodic job has been due (0 when none is): past a minute or two the "
            "periodic-job cluster (qcluster) is down or wedged.",
            value=(now - due).total_seconds() if due else 0.0,
        )


LEDGER_COLLECTOR = LedgerCollector()
# On the process's default registry (a module is imported once); the multi-process scrape
# registers it on its own registry as well.
prometheus_client.REGISTRY.register(LEDGER_COLLECTOR)


def scrape_allowed(request: HttpRequest) -> bool:
    """A bearer token equal to METRICS_TOKEN, or a logged-in active staff user."""
    token = settings.METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    if token and header.startswith("Bearer "):
        return hmac.compare_digest(header.removeprefix("Bearer ").encode(), token.encode())
    user = request.user
    return user.is_authenticated and user.is_active and user.is_staff


def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics: 404 unless METRICS_ENABLED; 401 without the token or a staff login."""
    if not settings.METRICS_ENABLED:
        raise Http404("Metrics are off (METRICS_ENABLED).")
    if not scrape_allowed(request):
        response = HttpResponse("Metrics need a bearer token (METRICS_TOKEN) or a staff login.\n", status=401,
                                content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        # Counters from every process's files, and the ledger's gauges read once, here.
        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(LEDGER_COLLECTOR)
        return HttpResponse(prometheus_client.generate_latest(registry), content_type=prometheus_client.CONTENT_TYPE_LATEST)
    return ExportToDjangoView(request)
