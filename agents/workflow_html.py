"""A workflow graph as plain HTML for the admin: one row per chain, fan-outs stacked, steps coloured by status."""

from __future__ import annotations

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from agents.workflows import START_NAME, step_kind

GRAPH_CSS = """
.wf-graph { margin: 0.5em 0 1em; }
.wf-chain { display: flex; align-items: center; flex-wrap: wrap; gap: 0.4em; margin: 0.4em 0; }
.wf-fan { display: flex; flex-direction: column; gap: 0.3em; padding-left: 0.4em; border-left: 2px solid var(--hairline-color, #ccc); }
.wf-arrow { color: var(--body-quiet-color, #888); }
.wf-step { border: 1px solid var(--hairline-color, #ccc); border-radius: 6px; padding: 0.25em 0.6em; background: var(--darkened-bg, #f8f8f8); font-size: 12px; }
.wf-step .wf-kind { color: var(--body-quiet-color, #888); font-size: 10px; display: block; }
.wf-step.wf-start { border-style: dashed; }
.wf-status-running { border-color: #1f6feb; background: #ddeeff; }
.wf-status-success { border-color: #2da44e; background: #dff5e3; }
.wf-status-error { border-color: #ba2121; background: #ffe4e1; }
.wf-status-cancelled { border-color: #9a6700; background: #fff4d6; }
"""


def _box(name: str, steps: dict, statuses: dict[str, str]) -> SafeString:
    if name == START_NAME:
        return mark_safe('<span class="wf-step wf-start">START</span>')
    spec = steps.get(name) or {}
    try:
        kind, target = step_kind(spec)
    except KeyError:
        kind, target = "?", ""
    label = f"{kind}: {target}" if target and target != name else kind
    status = statuses.get(name, "")
    status_text = f" · {status}" if status else ""
    return format_html(
        '<span class="wf-step{}" data-step="{}"><span class="wf-kind">{}{}</span>{}</span>',
        f" wf-status-{status}" if status else "",
        name,
        label,
        status_text,
        name,
    )


def render_graph(graph: dict, statuses: dict[str, str] | None = None) -> SafeString:
    """The chains of a (validated) graph; `statuses` colours steps by name (e.g. a run's steps)."""
    statuses = statuses or {}
    steps = graph.get("steps") or {}
    rows = []
    for chain in graph.get("chains") or []:
        parts = []
        for element in chain:
            if isinstance(element, list):
                inner = format_html_join("", "{}", ((_box(name, steps, statuses),) for name in element))
                parts.append(format_html('<span class="wf-fan">{}</span>', inner))
            else:
                parts.append(_box(element, steps, statuses))
        arrow = mark_safe('<span class="wf-arrow">→</span>')
        # Every part is already escaped by format_html.
        rows.append(format_html('<div class="wf-chain">{}</div>', mark_safe(arrow.join(parts))))
    return format_html('<div class="wf-graph">{}</div>', mark_safe("".join(rows)))
