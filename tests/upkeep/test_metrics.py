"""/metrics: who may scrape it, and the ledger's values after a known sequence of runs."""

from __future__ import annotations

from datetime import timedelta

import prometheus_client
import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone
from django_q.models import OrmQ
from prometheus_client.parser import text_string_to_metric_families

from runs.ledger import reconcile
from runs.models.inbox import EventStatus, WebhookEvent, WebhookSource
from runs.models.ledger import AgentRun, RunStatus, ToolCall, ToolCallStatus
from runs.refusals import ToolsCalled
from runs.services import run as services
from tests.helpers import LOOKUP, SAY_DONE, SEND_EMAIL, run_now, script_params
from tests.kit import login

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
pytestmark = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)  # executes runs: the agent loop's connections read what the test committed

TOKEN = "scrape-me-7c1f"


@pytest.fixture(autouse=True)
def _metrics_on(settings):
    settings.METRICS_ENABLED = True
    settings.METRICS_TOKEN = TOKEN
    settings.MODEL_RETRY_BASE_DELAY_SECONDS = 0


def scrape(client: Client | None = None, **headers) -> dict[tuple[str, tuple], float]:
    client = client or Client(headers={"Authorization": f"Bearer {TOKEN}"})
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def counter(name: str, **labels) -> float:
    return prometheus_client.REGISTRY.get_sample_value(f"{name}_total", labels) or 0.0


def test_metrics_are_off_unless_enabled(settings):
    settings.METRICS_ENABLED = False
    assert Client(headers={"Authorization": f"Bearer {TOKEN}"}).get("/metrics").status_code == 404


def test_a_scrape_needs_the_token_or_a_staff_login(alice, support_agent, settings):
    assert Client().get("/metrics").status_code == 401
    assert Client(headers={"Authorization": "Bearer wrong"}).get("/metrics").status_code == 401
    assert Client().get("/metrics")["WWW-Authenticate"].startswith("Bearer")
    user = login(alice)
    assert user.get("/metrics").status_code == 401
    staff = login(support_agent)
    assert staff.get("/metrics").status_code == 200
    settings.METRICS_TOKEN = ""
    # No token configured: a bearer header grants nothing, a staff login still does.
    assert Client(headers={"Authorization": "Bearer "}).get("/metrics").status_code == 401
    assert staff.get("/metrics").status_code == 200


@committed
def test_the_ledger_after_a_known_sequence_of_runs(alice):
    refusals_before = counter("agentledger_replay_refusals", code=ToolsCalled.code)
    retries_before = counter("agentledger_model_retries", reason="rate_limit")
    reconciled_before = counter("agentledger_reconciliations")

    run_now(params=script_params(LOOKUP, SAY_DONE))
    run_now(params=script_params({"fail": "rate_limit"}, SAY_DONE))  # one retry, then success
    failed = run_now(params=script_params(SEND_EMAIL, {"fail": "error", "message": "CRM down"}), created_by=alice)
    assert failed.status == RunStatus.ERROR
    with pytest.raises(ToolsCalled):
        services.replay_run(failed.run_id, actor=alice)

    # A worker that died mid-call: running, silent, one call never answered; the sweep reconciles it.
    dead = services.start_run(agent_name="support", message="Hi", owner_id="bob", enqueue=False)
    long_ago = timezone.now() - timedelta(hours=1)
    AgentRun.objects.filter(pk=dead.pk).update(status=RunStatus.RUNNING, started_at=long_ago, heartbeat_at=long_ago,
                                               worker="web-1:42", trigger="webhook")
    ToolCall.objects.create(run=dead, seq=1, call_id="c-1", tool_name="send_email", status=ToolCallStatus.CALLED)
    assert len(reconcile.reconcile_stale_runs()) == 1

    # In flight now: one running on a worker beating a few seconds ago, one queued (claimable).
    live = services.start_run(agent_name="support", message="Hi", owner_id="carol", enqueue=False)
    AgentRun.objects.filter(pk=live.pk).update(status=RunStatus.RUNNING, started_at=timezone.now(),
                                               heartbeat_at=timezone.now() - timedelta(seconds=5), worker="w-2:7")
    queued = services.start_run(agent_name="support", message="Hi", owner_id="dan", trigger="schedule")
    AgentRun.objects.filter(pk=queued.pk).update(created_at=timezone.now() - timedelta(seconds=30))
    assert not OrmQ.objects.exists()  # runs never pass through django-q2's broker

    source = WebhookSource.objects.create(slug="crm", name="CRM", agent_name="support", owner_id="jane",
                                          secret="s3cret", message_id_header="X-Message-Id")
    WebhookEvent.objects.create(source=source, external_id="m-1", payload={}, status=EventStatus.NEEDS_REVIEW)
    WebhookEvent.objects.create(source=source, external_id="m-2", payload={}, status=EventStatus.DONE)

    samples = scrape()

    def value(name: str, **labels) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    assert value("agentledger_runs_last_24h", status="success", trigger="api") == 2
    assert value("agentledger_runs_last_24h", status="error", trigger="api") == 1
    assert value("agentledger_runs_last_24h", status="error", trigger="webhook") == 1
    assert value("agentledger_runs_last_24h", status="running", trigger="api") == 1
    assert value("agentledger_runs_last_24h", status="queued", trigger="schedule") == 1
    assert value("agentledger_runs_in_flight", status="running", worker="w-2:7") == 1
    assert value("agentledger_runs_in_flight", status="queued", worker="") == 1
    assert 4 <= value("agentledger_heartbeat_age_max_seconds") < 60
    assert value("agentledger_tool_calls_in_doubt") == 1
    assert value("agentledger_webhook_events", status="needs_review") == 1
    assert value("agentledger_webhook_events", status="dead") == 0
    assert value("agentledger_webhook_events", status="done") is None  # terminal states are not watched
    assert value("agentledger_queue_depth", queue="agentledger") == 0
    assert value("agentledger_claimable_runs") == 1
    assert 30 <= value("agentledger_claimable_run_age_max_seconds") < 3600
    # The three runs executed here, and the one a worker claimed a moment ago.
    assert value("agentledger_runs_claimed_last_minute") == 4
    assert value("agentledger_periodic_jobs_lag_seconds") == 0  # no periodic job is set up here
    if connection.vendor == "postgresql":
        assert value("agentledger_worker_processes_alive") == 0

    assert value("agentledger_replay_refusals_total", code="tools_called") == refusals_before + 1
    assert value("agentledger_model_retries_total", reason="rate_limit") == retries_before + 1
    assert value("agentledger_reconciliations_total") == reconciled_before + 1
    # django-prometheus's request metrics are served beside them.
    assert any(name.startswith("django_http_requests") for name, _labels in samples)


def test_gauges_come_from_the_database_whichever_process_scrapes(alice, support_agent):
    """The gauges hold no state in the process: a row changed elsewhere shows at the next scrape."""
    run = services.start_run(agent_name="support", message="Hi", owner_id="eve", enqueue=False)
    before = scrape()
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.CANCELLED)
    after = scrape()
    key = ("agentledger_runs_in_flight", (("status", "queued"), ("worker", "")))
    assert before[key] == 1 and key not in after
