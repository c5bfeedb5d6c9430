"""Workflow definitions: the rules every door (admin form, API, runs) goes through."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from agents import redaction, workflows
from agents.effects import effect_of_call_name
from agents.models import WorkflowDefinition
from agents.registry import AGENTS, AgentNode, AgentSpec, ToolInfo, UnknownAgentError, get_agent_spec


def _graph_of(name: str) -> dict | None:
    return WorkflowDefinition.objects.filter(name=name).values_list("graph", flat=True).first()


def check_workflow(*, name: Any, graph: Any, instance_pk: int | None = None) -> tuple[str, dict]:
    """Validate a definition; return (name, graph) or raise ValidationError naming each problem.

    Besides the graph's own rules, the workflows it runs must exist and must not run this one
    (directly or through others): a workflow cannot include itself.
    """
    errors: dict[str, list[str]] = {}
    try:
        name = workflows.validate_workflow_name(name)
    except workflows.WorkflowGraphError as exc:
        errors["name"] = exc.problems
    else:
        taken = WorkflowDefinition.objects.filter(name=name)
        if instance_pk is not None:
            taken = taken.exclude(pk=instance_pk)
        if taken.exists():
            errors["name"] = [f"A workflow called “{name}” already exists."]
    try:
        workflows.validate_graph(graph, workflow_exists=lambda other: other == name or _graph_of(other) is not None)
    except workflows.WorkflowGraphError as exc:
        errors["graph"] = exc.problems
    if not errors:
        try:
            # The stored graph of `name` is the one being replaced: resolve against the new one.
            workflows.snapshot(name, graph, lookup=lambda other: graph if other == name else _graph_of(other))
        except workflows.WorkflowGraphError as exc:
            errors["graph"] = exc.problems
    if errors:
        raise ValidationError(errors)
    return name, graph


def save_workflow(
    *, name: Any, graph: Any, description: Any = "", actor: Any = None, instance: WorkflowDefinition | None = None
) -> WorkflowDefinition:
    """Create or replace a definition after validating it (the API's door; the admin uses clean())."""
    if not isinstance(description, str):
        raise ValidationError({"description": "description must be a string."})
    with transaction.atomic():
        name, graph = check_workflow(name=name, graph=graph, instance_pk=instance.pk if instance else None)
        definition = instance or WorkflowDefinition()
        definition.name, definition.graph, definition.description = name, graph, description
        definition.updated_at = timezone.now()
        definition.updated_by = actor if getattr(actor, "is_authenticated", False) else None
        definition.save()
    return definition


def workflow_snapshot(name: str) -> dict | None:
    """What a run of `name` stores and executes, resolved now; None if there is no such workflow."""
    graph = _graph_of(name)
    if graph is None:
        return None
    return workflows.snapshot(name, graph, lookup=_graph_of)


def resolve_runnable(name: Any) -> AgentSpec | dict:
    """A registered agent's spec, or a workflow's snapshot; UnknownAgentError naming both kinds."""
    if isinstance(name, str) and name in AGENTS:
        return get_agent_spec(name)  # raises AgentUnavailableError for a package that did not load
    snap = workflow_snapshot(name) if isinstance(name, str) else None
    if snap is None:
        known = sorted(WorkflowDefinition.objects.values_list("name", flat=True)[:50])
        error = UnknownAgentError(name if isinstance(name, str) else repr(name))
        error.args = (f"{error.args[0]} Workflows: {', '.join(known) or 'none'}.",)
        raise error
    return snap


# --- The loaded agents, as the API and the admin show them ------------------------------------------

CONFIGURE_AGENTS = "agents.configure_agents"


def can_configure_agents(user: Any) -> bool:
    """Who sees a tool's source unredacted: MCP command lines and URLs, paths, load errors' text."""
    return user is not None and user.has_perm(CONFIGURE_AGENTS)


def _tool_view(tool: ToolInfo, *, full: bool) -> dict:
    return {
        "name": tool.name,
        "source": tool.source,
        "detail": tool.detail if full else tool.shown_detail,
        "effect": tool.effect,
        "effect_reason": tool.effect_reason,
        "annotations": dict(tool.annotations),
    }


def _node_view(node: AgentNode, *, full: bool) -> dict:
    return {
        "name": node.name,
        "kind": node.kind,
        "description": node.description,
        "tools": [_tool_view(tool, full=full) for tool in node.tools],
        "transfer_targets": list(node.transfer_targets),
        "tool_errors": list(node.tool_errors if full else node.public_tool_errors),
        "sub_agents": [_node_view(child, full=full) for child in node.sub_agents],
        "tool_agents": [_node_view(child, full=full) for child in node.tool_agents],
    }


def agent_view(spec: AgentSpec, *, full: bool) -> dict:
    """One loaded agent package: what `GET /api/agents/{name}/` answers and the admin shows.

    `full` (people who may configure agents) shows the sources as they are; otherwise they are
    redacted (agents.redaction): a command line, a URL or an error's text can carry a secret.
    """
    nodes = list(spec.tree.walk()) if spec.tree is not None else []
    return {
        "name": spec.name,
        "description": spec.description,
        "path": spec.path if full else redaction.public_text(spec.path),
        "load_error": spec.load_error if full else redaction.public_text(spec.load_error),
        "tool_errors": [
            error for node in nodes for error in (node.tool_errors if full else node.public_tool_errors)
        ],
        "tools": [_tool_view(tool, full=full) for tool in spec.tools],
        "has_default_script": bool(spec.default_script or spec.default_scripts),
        "tree": _node_view(spec.tree, full=full) if spec.tree is not None else None,
    }


def agent_views(*, user: Any) -> list[dict]:
    full = can_configure_agents(user)
    return [agent_view(AGENTS[name], full=full) for name in sorted(AGENTS)]


def find_agent_view(name: str, *, user: Any) -> dict | None:
    spec = AGENTS.get(name)
    return agent_view(spec, full=can_configure_agents(user)) if spec is not None else None


def agents_dir_view(*, user: Any) -> list[str]:
    """AGENTS_DIR as the admin shows it: folders by name only to people who may not configure agents."""
    directories = [str(directory) for directory in settings.AGENTS_DIR]
    return directories if can_configure_agents(user) else [redaction.public_text(d) for d in directories]


def tool_effect_now(*, agent: str, agent_node: str, tool: str) -> ToolInfo | None:
    """The tool `tool` of the agent `agent_node` in the package `agent`, as loaded now (or None)."""
    spec = AGENTS.get(agent)
    found = None
    if spec is not None and spec.tree is not None:
        node = next((node for node in spec.tree.walk() if node.name == (agent_node or spec.tree.name)), None)
        found = next((info for info in node.tools if info.name == tool), None) if node is not None else None
    if found is None and (control := effect_of_call_name(tool)) is not None:
        # ADK's own calls (a transfer, a confirmation request) are on no agent's list of tools.
        return ToolInfo(name=tool, source="builtin", effect=control.kind, effect_reason=control.source)
    return found
