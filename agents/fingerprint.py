"""A fingerprint of an agent's definition: what a resumed run must still be running.

A run that is resumed continues its own session with the model it had: the session holds the
calls the model made under the instruction and tools it was given. If the package changed since
(another instruction, a tool added or removed, a tool's effect class, the model), continuing that
conversation would mix two agents, so a resume is refused and a replay is the way.

The fingerprint is sha256 of a canonical JSON description of the loaded tree: each agent's name,
kind, instruction, model as declared and tools (with their effect classes and idempotency keys),
its sub-agents and the agents its tools wrap, recursively. It names no object ids or memory
addresses, so two processes that loaded the same package agree. A workflow's fingerprint covers
its stored graph and the agents its steps run.

No Django here: it reads only the loaded objects (`agents.loading.AgentSpec`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection
from typing import Any

from agents.effects import effect_of_tool, tool_name

MAX_DEPTH = 50


def _callable_name(value: Any) -> str:
    module = getattr(value, "__module__", "") or ""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or type(value).__qualname__
    return f"{module}.{name}" if module else str(name)


def _text(value: Any) -> Any:
    """An instruction: its text, or the name of the function that provides it."""
    if value is None or isinstance(value, str):
        return value or ""
    if callable(value):
        return {"provider": _callable_name(value)}
    return {"type": type(value).__qualname__}


def _model(agent: Any) -> Any:
    model = getattr(agent, "model", None)
    if model is None or isinstance(model, str):
        return model or ""
    return {"type": _callable_name(type(model)), "model": getattr(model, "model", "")}


def _key(effect: Any) -> Any:
    key = effect.key
    if key is None:
        return None
    if callable(key):
        return {"function": _callable_name(key)}
    return list(key)


def _tool(tool: Any, trusted_servers: Collection[str], depth: int) -> dict[str, Any]:
    agent = getattr(tool, "agent", None)
    if agent is not None and hasattr(agent, "sub_agents"):
        return {"agent_tool": tool_name(tool) or "", "agent": describe_agent(agent, trusted_servers, depth + 1)}
    if getattr(tool, "get_tools", None) is not None and not hasattr(tool, "run_async"):
        # A toolset lists its tools only when it runs; its kind and its filter say what it offers.
        tool_filter = getattr(tool, "tool_filter", None)
        return {
            "toolset": _callable_name(type(tool)),
            "filter": sorted(tool_filter) if isinstance(tool_filter, list | tuple | set) else _text(tool_filter),
        }
    effect = effect_of_tool(tool, trusted_servers=trusted_servers)
    func = getattr(tool, "func", None)
    return {
        "name": tool_name(tool) or "",
        "type": _callable_name(type(tool)) if func is not None or not callable(tool) else "function",
        "function": _callable_name(func if func is not None else tool) if callable(func or tool) else "",
        "effect": effect.kind,
        "key": _key(effect),
        "stable": list(effect.stable),
    }


def describe_agent(agent: Any, trusted_servers: Collection[str] = (), depth: int = 0) -> dict[str, Any]:
    """The parts of one agent (and everything under it) that decide how it acts."""
    if depth > MAX_DEPTH:
        raise ValueError(f"The agent tree is deeper than {MAX_DEPTH} levels.")
    return {
        "name": getattr(agent, "name", ""),
        "kind": type(agent).__name__,
        "instruction": _text(getattr(agent, "instruction", None)),
        "global_instruction": _text(getattr(agent, "global_instruction", None)),
        "model": _model(agent),
        "tools": [_tool(tool, trusted_servers, depth) for tool in getattr(agent, "tools", None) or []],
        "sub_agents": [describe_agent(child, trusted_servers, depth + 1) for child in agent.sub_agents or []],
    }


def digest(description: Any) -> str:
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def agent_fingerprint(root: Any, *, trusted_servers: Collection[str] = ()) -> str:
    """sha256 hex of a loaded agent tree's definition."""
    return digest(describe_agent(root, tuple(sorted(trusted_servers))))


def workflow_fingerprint(
    snapshot: dict, *, agent_root: Callable[[str], Any], trusted_servers: Collection[str] = ()
) -> str:
    """sha256 hex of a workflow's stored graph and of every agent its steps run (`agent_root(name)`)."""
    agents: dict[str, Any] = {}

    def collect(graph: dict) -> None:
        for spec in (graph.get("steps") or {}).values():
            target = spec.get("agent") if isinstance(spec, dict) else None
            if isinstance(target, str) and target not in agents:
                agents[target] = describe_agent(agent_root(target), tuple(sorted(trusted_servers)))

    collect(snapshot.get("graph") or {})
    for graph in (snapshot.get("workflows") or {}).values():
        collect(graph)
    return digest({"workflow": snapshot, "agents": agents})
