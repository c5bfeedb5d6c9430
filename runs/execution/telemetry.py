"""A run as one trace: its span, its id on every span and log line inside, its trace id kept.

`run_scope` wraps a run's execution in the worker (and a chat turn on the server's loop): it
binds the run id for `config.lib.observability` (spans and logs), opens the run's span, under
which ADK's agent, model and tool spans nest, and stores the trace id on the run so its admin
page can name the trace to look up. Without a configured tracer the span records nothing and
no trace id is stored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from config.lib.observability import RUN_ID_ATTRIBUTE, bound_run_id
from runs.models.ledger import AgentRun, RunStatus

if TYPE_CHECKING:
    from runs.ledger.outcomes import Outcome

tracer = trace.get_tracer("agent_ledger.runs")


@dataclass
class RunScope:
    span: Span

    def settled(self, outcome: Outcome) -> Outcome:
        """Record the outcome on the run's span and hand it back (the executor returns it)."""
        self.span.set_attribute("agent_ledger.status", outcome.status)
        if outcome.error_code:
            self.span.set_attribute("agent_ledger.error_code", outcome.error_code)
        if outcome.status == RunStatus.ERROR:
            self.span.set_status(Status(StatusCode.ERROR, outcome.error_code or "error"))
        return outcome


@asynccontextmanager
async def run_scope(run: AgentRun) -> AsyncIterator[RunScope]:
    with bound_run_id(str(run.run_id)):
        attributes = {RUN_ID_ATTRIBUTE: str(run.run_id), "agent_ledger.agent": run.agent_name,
                      "agent_ledger.trigger": run.trigger}
        with tracer.start_as_current_span(f"run {run.agent_name}", attributes=attributes) as span:
            context = span.get_span_context()
            if context.is_valid and context.trace_flags.sampled:
                await AgentRun.objects.filter(pk=run.run_id).aupdate(trace_id=format(context.trace_id, "032x"))
            yield RunScope(span)
