"""The tree one run executes: a copy of the loaded agent tree with the ledger's wrapping.

The loaded tree is shared by every run of the process and is never changed. For each run every
agent is cloned (ADK's `BaseAgent.clone`), and on every `LlmAgent` — sub-agents, agents wrapped
by an `AgentTool`, children of Sequential/Parallel/Loop agents — the copy gets:

- the memory diet first among its before-model callbacks (`agents.diet`);
- its model wrapped in `RetryingLlm` (rate limits and empty turns retried at the call), the model
  being the run's scripted model offline, `AGENT_MODEL` if it names one, else the agent's own
  (a name or a model object, inherited from its ancestors as ADK does);
- per-run copies of what carries state: ADK's `preload_memory` becomes the once-per-run
  `PreloadMemoryOncePerInvocation`, an `McpToolset` gets its own MCP session.

Everything a run changes (the script's position, the memory search cache, the MCP session) lives
in these copies, so concurrent runs of one agent never see each other.
"""

from __future__ import annotations

import copy
from typing import Any

from django.conf import settings
from google.adk.agents import BaseAgent, LlmAgent
from google.adk.models.base_llm import BaseLlm
from google.adk.models.registry import LLMRegistry
from google.adk.tools.agent_tool import AgentTool
from google.adk.tools.preload_memory_tool import PreloadMemoryTool

from agents import diet
from agents.loading import AgentSpec, is_mcp_toolset, per_run_mcp_toolset
from agents.preload import PreloadMemoryOncePerInvocation
from agents.retrying import RetryingLlm
from agents.scripted import ScriptedLlm, ScriptPosition


def uses_scripted_model() -> bool:
    return settings.AGENT_MODEL == "scripted"


def run_scripts(spec: AgentSpec, params: dict) -> dict[str, list]:
    """The script each LlmAgent of the tree plays in this run, by agent name.

    An agent plays the run's script for it (`params.script` for the root, `params.scripts` by
    name), else the package's default for it (with SCRIPTED_DEFAULT_SCRIPTS), else nothing (it then answers that it has nothing
    more to add).
    """
    root_name = spec.root.name if spec.root is not None else spec.name
    scripts: dict[str, list] = {}
    if settings.SCRIPTED_DEFAULT_SCRIPTS:  # the demo's scripts: off in production unless asked for
        scripts.update({name: list(steps) for name, steps in spec.default_scripts.items()})
        if spec.default_script:
            scripts.setdefault(root_name, list(spec.default_script))
    for name, steps in (params.get("scripts") or {}).items():
        scripts[name] = list(steps)
    if params.get("script"):
        scripts[root_name] = list(params["script"])
    return scripts


def _model_for(agent: LlmAgent, scripts: dict[str, list], positions: dict[str, ScriptPosition]) -> RetryingLlm:
    if uses_scripted_model():
        inner: BaseLlm = ScriptedLlm(
            script=scripts.get(agent.name, []), position=positions.get(agent.name) or ScriptPosition()
        )
    elif settings.AGENT_MODEL:
        inner = LLMRegistry.new_llm(settings.AGENT_MODEL)
    else:
        # The loaded agent still knows its parents, so a model inherited from an ancestor (or
        # ADK's default) resolves as it would under `adk web`.
        inner = agent.canonical_model
    if isinstance(inner, RetryingLlm):
        return inner
    return RetryingLlm(inner=inner)


def _callbacks(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _tool_for_run(tool: Any, scripts: dict[str, list], positions: dict[str, ScriptPosition]) -> Any:
    if isinstance(tool, AgentTool):
        run_tool = copy.copy(tool)
        # An agent used as a tool runs in ADK's in-memory session: a resume starts its script afresh.
        run_tool.agent = build_run_agent(tool.agent, scripts)
        return run_tool
    if isinstance(tool, PreloadMemoryTool) and not isinstance(tool, PreloadMemoryOncePerInvocation):
        return PreloadMemoryOncePerInvocation()
    if is_mcp_toolset(tool):
        return per_run_mcp_toolset(tool)
    return tool


def build_run_agent(
    agent: BaseAgent, scripts: dict[str, list], positions: dict[str, ScriptPosition] | None = None
) -> BaseAgent:
    """A wrapped copy of `agent` and everything inside it; `agent` itself is left as it is.

    `positions` (by agent name) is where a resumed run's scripted models start.
    """
    positions = positions or {}
    update: dict[str, Any] = {
        "sub_agents": [build_run_agent(child, scripts, positions) for child in agent.sub_agents]
    }
    if isinstance(agent, LlmAgent):
        callbacks = [cb for cb in _callbacks(agent.before_model_callback) if cb is not diet.strip_old_payloads]
        update["model"] = _model_for(agent, scripts, positions)
        update["tools"] = [_tool_for_run(tool, scripts, positions) for tool in agent.tools]
        update["before_model_callback"] = [diet.strip_old_payloads, *callbacks]
    return agent.clone(update=update)


def build_run_tree(
    spec: AgentSpec, *, params: dict, positions: dict[str, ScriptPosition] | None = None
) -> BaseAgent:
    return build_run_agent(spec.root, run_scripts(spec, params), positions)
