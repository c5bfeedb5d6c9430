"""What the run page shows beside the record: labels, the replay chain, the decision now, the steps.

Also the stored input file's download, which never reveals the path on disk.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from django.conf import settings
from django.contrib.admin.utils import unquote
from django.http import FileResponse, Http404
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from agents.workflow_html import GRAPH_CSS, render_graph
from config.lib.admin import ObjectButton
from runs.admin.actions import change_url
from runs.ledger import chain
from runs.models.ledger import UNSETTLED, AgentRun, RunStatus
from runs.rules import permissions
from runs.rules import replay as rules


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


# --- The top of the run page: the outcome in words, then what needs a person ---------------------

# ADK's names for its own machinery: a support person is never shown them.
PLUMBING_WORDS = ("adk_request_confirmation", "FunctionResponse", "ToolConfirmation", "originalFunctionCall",
                  "function_call", "function_response")
STATUS_TONES = {"success": "good", "error": "bad", "cancelled": "quiet", "waiting": "attention",
                "running": "busy", "queued": "busy"}


def plain_hint(hint: str) -> str:
    """The tool's hint without ADK's sentences on how to answer it through its API."""
    sentences = re.split(r"(?<=[.!?])\s+", hint or "")
    return " ".join(s for s in sentences if not any(word in s for word in PLUMBING_WORDS)).strip()


def chain_end(run: AgentRun) -> dict | None:
    """Where the work this run started ended: its newest successor, followed down to the last one."""
    node, hops, last = run, 0, None
    while hops < MAX_CHAIN_RUNS:
        found = chain.successors(node)
        if not found:
            break
        last = found[0]
        node = AgentRun(run_id=last.run_id, status=last.status)
        hops += 1
    if last is None:
        return None
    how = "resumed" if AgentRun.objects.filter(pk=last.run_id, resume_of__isnull=False).exists() else "replayed"
    return {"run_id": last.run_id, "status": last.status, "how": how, "hops": hops,
            "url": change_url(AgentRun(run_id=last.run_id))}


def outcome_context(run: AgentRun, *, waiting_calls, calls_in_doubt) -> dict:
    """The page's first lines: the status, the outcome in words, and where the chain ended."""
    if run.status == "success":
        words = run.result or "It finished without a final answer."
    elif run.status in ("error", "cancelled"):
        words = " ".join(filter(None, [run.error_message or run.error_code or run.status]))
    elif run.status == "waiting":
        words = "It waits for a person; nothing it was asked about has run."
    else:
        words = "It is queued for a worker." if run.status == "queued" else "A worker is running it now."
    for call in waiting_calls:
        call.plain_hint = plain_hint(call.hint)
    return {
        "tools_ran_label": tools_label(run),
        "status_tone": STATUS_TONES.get(run.status, "quiet"),
        "outcome_words": words,
        "needs_you": bool(waiting_calls or calls_in_doubt),
        "chain_end": chain_end(run) if run.status not in ("queued", "running", "waiting") else None,
    }


def page_buttons(modeladmin, request, run: AgentRun, *, decision: dict, resume_decision) -> list[ObjectButton]:
    """The run page's buttons: what the rules allow now; what they refuse is shown greyed, with why.

    The reasons are the rules' own (runs.rules.replay.decide, runs.rules.resume.decide_resume), never re-derived."""
    buttons = []
    if modeladmin.has_replay_permission(request, run):
        buttons.append(ObjectButton("replay_selected", "Replay", "replay-button",
                                    "" if decision["allowed"] else decision["message"]))
    if modeladmin.has_force_replay_permission(request):
        buttons.append(ObjectButton("force_replay_selected", "Force replay…", "force-replay-button",
                                    "" if decision["force_would_replay"] else decision["force_message"]))
    if run.status in UNSETTLED and modeladmin.has_cancel_permission(request, run):
        buttons.append(ObjectButton("cancel_selected", "Cancel run", "cancel-button"))
    elif run.status in (RunStatus.ERROR, RunStatus.CANCELLED) and permissions.may_resume(actor=request.user, run=run):
        refused = "" if resume_decision is None or resume_decision.allowed else resume_decision.refusal.admin_detail
        buttons.append(ObjectButton("resume_selected", "Resume…", "resume-button", refused))
    return buttons
