"""Traces and logs that name the run they belong to.

One context variable, `current_run_id`, is set while a run executes (`runs.execution.telemetry`). ADK
creates its tasks inside that context, so everything the run does sees it:

- `RunIdSpanProcessor` stamps it on every span started meanwhile (ADK's agent, model and tool
  spans, the database spans of instrumented clients) as `agent_ledger.run_id`;
- `RunIdLogFilter` puts it on every log record as `run_id` ("-" outside a run), and
  `JsonLinesFormatter` writes records as JSON lines (`LOG_FORMAT=json`) with it and the
  current trace and span ids.

`configure_tracing` installs the OpenTelemetry SDK with an OTLP/HTTP exporter when
`OTEL_EXPORTER_OTLP_ENDPOINT` is set, and Django's request instrumentation with it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.django import DjangoInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

RUN_ID_ATTRIBUTE = "agent_ledger.run_id"
current_run_id: ContextVar[str | None] = ContextVar("agent_ledger_run_id", default=None)


@contextmanager
def bound_run_id(run_id: str) -> Iterator[None]:
    """Everything logged or traced inside names this run."""
    token = current_run_id.set(run_id)
    try:
        yield
    finally:
        current_run_id.reset(token)


class RunIdSpanProcessor(SpanProcessor):
    """Stamps the run id of the current context on each span as it starts."""

    def on_start(self, span: Span, parent_context=None) -> None:
        run_id = current_run_id.get()
        if run_id is not None:
            span.set_attribute(RUN_ID_ATTRIBUTE, run_id)

    def on_end(self, span: ReadableSpan) -> None:
        pass


class RunIdLogFilter(logging.Filter):
    """Adds `run_id` to every record, so a plain format can name it and JSON lines carry it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.run_id = current_run_id.get() or "-"
        return True


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, run and trace ids, exception."""

    def format(self, record: logging.LogRecord) -> str:
        run_id = getattr(record, "run_id", "-")
        entry = {
            "time": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "run_id": None if run_id == "-" else run_id,
        }
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            entry["trace_id"] = format(context.trace_id, "032x")
            entry["span_id"] = format(context.span_id, "016x")
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def tracer_provider(*, service_name: str) -> TracerProvider:
    """The process's SDK provider with the run-id processor, installed once as the global one."""
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        provider = current
    else:
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        trace.set_tracer_provider(provider)
    if not getattr(provider, "_agent_ledger_run_ids", False):
        provider.add_span_processor(RunIdSpanProcessor())
        provider._agent_ledger_run_ids = True
    return provider


def configure_tracing(*, service_name: str, endpoint: str = "", exporter: SpanExporter | None = None) -> TracerProvider:
    """Export spans to `exporter`, or over OTLP/HTTP to `endpoint` (the collector's base URL)."""
    provider = tracer_provider(service_name=service_name)
    if exporter is None:
        # The generic endpoint names the collector; traces go to its /v1/traces, as the spec says.
        exporter = OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def instrument_django() -> None:
    """Django's requests as spans (adds its middleware; call before the first request)."""
    instrumentor = DjangoInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()


def configure_from_settings(settings) -> bool:
    """Tracing as the settings say: on when OTEL_EXPORTER_OTLP_ENDPOINT is set. True if on."""
    if not settings.OTEL_EXPORTER_OTLP_ENDPOINT:
        return False
    configure_tracing(service_name=settings.OTEL_SERVICE_NAME, endpoint=settings.OTEL_EXPORTER_OTLP_ENDPOINT)
    instrument_django()
    return True
