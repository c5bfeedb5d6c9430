"""What the run page shows beside the record: labels, the replay chain, the decision now, the steps.

Also the stored input file's download, which never reveals the path on disk.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from django.conf import settings
from django.contrib.admin.utils import unquote
from django.http import FileResponse, Http404
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from agents.workflow_html import GRAPH_CSS, render_graph
from runs import chain
from runs import replay as rules
from runs.admin.actions import change_url
from runs.models import AgentRun


def tools_label(run: AgentRun) -> str:
    """unknown / none / each tool once in first-call order, with a count when called repeatedly."""
    if run.tools_executed is None:
        return "unknown"
    counts = Counter(run.tools_executed)
    return ", ".join(
        name if counts[name] == 1 else f"{name} ×{counts[name]}" for name in dict.fromkeys(run.tools_executed)
    ) or "none"


def retries_label(run: AgentRun) -> str:
    """The model calls retried at the boundary (rate limits, empty turns), one line each."""
    entries = run.model_retries or []
    if not entries:
        return "none"
    lines = []
    for entry in entries:
        reason = str(entry.get("reason", "?")).replace("_", " ")
        waited = f", waited {entry['waited_s']:g} s" if entry.get("waited_s") else ""
        lines.append((reason, entry.get("attempt", "?"), waited, entry.get("at", "")))
    count = f"{len(entries)} retr{'y' if len(entries) == 1 else 'ies'}"
    return format_html(
        "{}:<ul>{}</ul>",
        count,
        format_html_join("", "<li>{} (attempt {}{}) at {}</li>", lines),
    )


def pretty_json(value) -> str:
    return format_html('<pre class="run-json">{}</pre>', json.dumps(value, indent=2, ensure_ascii=False))


def workflow_steps_context(run: AgentRun) -> dict:
    """A workflow run's graph coloured by step status, and its steps as bars on one time axis."""
    if not run.workflow:
        return {}
    steps = list(run.steps.order_by("seq"))
    top_level = {step.step_name: step.status for step in steps if step.depth == 0}
    origin = min((step.started_at for step in steps), default=None)
    end = max((step.finished_at or run.finished_at or timezone.now() for step in steps), default=None)
    span = max((end - origin).total_seconds(), 0.001) if origin and end else 1.0
    rows = []
    for step in steps:
        finished = step.finished_at or run.finished_at or timezone.now()
        left = (step.started_at - origin).total_seconds() / span * 100 if origin else 0
        width = max((finished - step.started_at).total_seconds() / span * 100, 0.5)
        rows.append({"step": step, "left": f"{left:.2f}", "width": f"{min(width, 100 - left):.2f}",
                     "indent": step.depth * 1.2})
    return {
        "step_graph": render_graph(run.workflow["graph"], top_level),
        "step_graph_css": GRAPH_CSS,
        "step_rows": rows,
        "workflow_name": run.workflow.get("name", run.agent_name),
    }


def stored_input_path(run: AgentRun) -> Path | None:
    """The stored copy, if it exists and lies inside RUN_INPUTS_DIR (a row is never trusted blindly)."""
    if not run.input_file:
        return None
    root = Path(settings.RUN_INPUTS_DIR).resolve()
    path = Path(run.input_file).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        return None
    return path


def input_file_view(modeladmin, request, object_id):
    """Streams the run's stored input file to staff who may view the run; the disk path stays hidden."""
    run = modeladmin.get_object(request, unquote(object_id))
    if run is None or not modeladmin.has_view_permission(request, run):
        raise Http404("No such run.")
    path = stored_input_path(run)
    if path is None:
        raise Http404("This run has no stored input file, or it is gone from disk.")
    return FileResponse(path.open("rb"), as_attachment=True, filename=run.input_file_name or path.name)


# --- The run page --------------------------------------------------------------------------------

MAX_CHAIN_RUNS = 200


def replay_chain(run: AgentRun) -> list[dict]:
    """The run's family: up to the first original, then every replay below it, indented."""
    root = chain.root_of(run, via=chain.REPLAYS, limit=MAX_CHAIN_RUNS)
    children: dict = {}
    level = [root.run_id]
    total = 1
    while level and total < MAX_CHAIN_RUNS:
        found = list(AgentRun.objects.filter(replay_of_id__in=level).order_by("created_at")[:MAX_CHAIN_RUNS])
        for child in found:
            children.setdefault(child.replay_of_id, []).append(child)
        total += len(found)
        level = [child.run_id for child in found]

    rows: list[dict] = []

    def walk(node: AgentRun, depth: int) -> None:
        rows.append({"run": node, "depth": depth, "indent": depth * 1.5, "url": change_url(node),
                     "current": node.run_id == run.run_id})
        for child in children.get(node.run_id, []):
            walk(child, depth + 1)

    walk(root, 0)
    return rows


def decision_now(run: AgentRun) -> dict:
    """What a replay would do now, in the admin's words, without and with force."""
    facts = rules.gather_facts(run)
    plain = rules.decide(run, force=False, facts=facts)
    forced = rules.decide(run, force=True, facts=facts)
    return {
        "allowed": plain.allowed,
        "code": plain.code,
        "message": "A replay would start now." if plain.allowed else plain.refusal.admin_detail,
        "force_would_replay": forced.allowed,
        "force_message": "" if forced.allowed else forced.refusal.admin_detail,
        "preview": rules.preview(facts),
        "facts": facts,
    }
