"""Traces and logs name their run: spans exported in-process and over real OTLP/HTTP, JSON lines."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from config.lib.observability import (
    RUN_ID_ATTRIBUTE,
    JsonLinesFormatter,
    RunIdLogFilter,
    bound_run_id,
    configure_tracing,
)
from tests.helpers import LOOKUP, SAY_DONE, SEND_EMAIL, run_now, run_python, script_params
from tests.kit import login

# Runs on the agent loop and child processes read what the test committed.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def exported():
    """Spans of this process, collected in memory (the SDK provider is the process's global one)."""
    exporter = InMemorySpanExporter()
    provider = configure_tracing(service_name="agent-ledger-test", exporter=exporter)
    yield lambda: (provider.force_flush(), exporter.get_finished_spans())[1]
    exporter.shutdown()  # later tests' spans are dropped, not kept in memory


def test_every_span_of_a_run_carries_its_run_id_and_the_run_keeps_its_trace_id(exported, admin_user):
    run = run_now(params=script_params(LOOKUP, SEND_EMAIL, SAY_DONE))
    spans = [span for span in exported() if span.attributes.get(RUN_ID_ATTRIBUTE) == str(run.run_id)]
    names = [span.name for span in spans]
    assert "run support" in names
    # ADK's own spans: the agent, each model call, each tool.
    assert any(name.startswith("invoke_agent") for name in names), names
    assert any(name.startswith("execute_tool") and "send_email" in name for name in names), names
    root = next(span for span in spans if span.name == "run support")
    assert root.attributes["agent_ledger.status"] == "success"
    assert {span.context.trace_id for span in spans} == {root.context.trace_id}
    assert run.trace_id == format(root.context.trace_id, "032x")

    client = login(admin_user)
    page = client.get(f"/admin/runs/agentrun/{run.run_id}/change/").content.decode()
    assert run.trace_id in page


def test_a_failed_run_marks_its_span_as_an_error(exported):
    run = run_now(params=script_params(SEND_EMAIL, {"fail": "error", "message": "CRM down"}))
    root = next(span for span in exported()
                if span.name == "run support" and span.attributes.get(RUN_ID_ATTRIBUTE) == str(run.run_id))
    assert root.status.status_code == trace.StatusCode.ERROR
    assert root.attributes["agent_ledger.error_code"] == "model_error"


def test_log_records_carry_the_run_id_and_json_lines_the_trace_ids(exported):
    record_filter, formatter = RunIdLogFilter(), JsonLinesFormatter()
    tracer = trace.get_tracer("test")

    def line(message: str) -> dict:
        record = logging.LogRecord("runs.test", logging.WARNING, __file__, 1, message, None, None)
        record_filter.filter(record)
        return json.loads(formatter.format(record))

    outside = line("before")
    assert outside["run_id"] is None and "trace_id" not in outside
    with bound_run_id("1b4e28ba-2fa1-11d2-883f-0016d3cca427"), tracer.start_as_current_span("work") as span:
        inside = line("during")
    assert inside["run_id"] == "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert inside["message"] == "during" and inside["level"] == "WARNING" and inside["logger"] == "runs.test"


@pytest.mark.slow
def test_log_format_json_makes_every_line_json_with_the_run_id():
    result = run_python(
        "import logging\n"
        "from config.lib.observability import bound_run_id\n"
        "with bound_run_id('run-42'):\n"
        "    logging.getLogger('runs.execution.executor').warning('inside %s', 'a run')\n"
        "logging.getLogger('runs.execution.executor').warning('outside')\n",
        LOG_FORMAT="json",
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(text) for text in result.stderr.strip().splitlines()]
    assert [(line["message"], line["run_id"]) for line in lines] == [("inside a run", "run-42"), ("outside", None)]


class OtlpReceiver(BaseHTTPRequestHandler):
    """A real OTLP/HTTP endpoint: decodes each protobuf export request it is sent."""

    received: list[ExportTraceServiceRequest] = []

    def do_POST(self):  # noqa: N802 - the http.server API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        OtlpReceiver.received.append((self.path, request))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_spans_go_over_otlp_http_when_the_endpoint_is_set(tmp_path):
    """A child process configured only by the environment: Django's request and a run, exported."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), OtlpReceiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    OtlpReceiver.received = []
    try:
        result = run_python(
            "from django.test import Client\n"
            "from opentelemetry import trace\n"
            "from tests.helpers import run_now\n"
            "Client().get('/admin/login/', HTTP_HOST='localhost')\n"
            "run = run_now()\n"
            "trace.get_tracer_provider().force_flush()\n"
            "print(run.run_id, run.trace_id)\n",
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{server.server_port}",
            OTEL_SERVICE_NAME="ledger-under-test",
        )
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    run_id, trace_id = result.stdout.split()
    spans, services = [], set()
    for path, request in OtlpReceiver.received:
        assert path == "/v1/traces"
        for resource_spans in request.resource_spans:
            services |= {a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"}
            for scope_spans in resource_spans.scope_spans:
                spans.extend(scope_spans.spans)
    assert services == {"ledger-under-test"}
    assert any(span.name.startswith("GET") for span in spans), [span.name for span in spans]
    run_spans = [span for span in spans
                 if any(a.key == RUN_ID_ATTRIBUTE and a.value.string_value == run_id for a in span.attributes)]
    assert len(run_spans) >= 3
    assert {span.trace_id.hex() for span in run_spans} == {trace_id}
