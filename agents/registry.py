"""The agents Agent Ledger can run, by name: the packages of `AGENTS_DIR`, loaded once per process.

The registry is built on first use (not when settings are imported) from what ADK's loader
loaded (`agents.loading`). `AGENTS` maps every package name to its `AgentSpec`, the broken ones
included (with their `load_error`), so lists can show them; `get_agent_spec` answers only agents
that can run. Each run executes its own wrapped copy of the loaded tree (`agents.run_tree`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, MutableMapping
from typing import Any

from django.conf import settings
from google.adk.agents import BaseAgent
from google.adk.apps import App

from agents.fingerprint import agent_fingerprint, workflow_fingerprint
from agents.loading import TRANSFER_TOOL, AgentNode, AgentSpec, ToolInfo, describe, load_agents
from agents.run_tree import build_run_tree, run_scripts, uses_scripted_model
from agents.scripted import ScriptError, ScriptPosition, refuse_repeated_call_ids, validate_script

__all__ = [
    "AGENTS",
    "TRANSFER_TOOL",
    "AgentNode",
    "AgentSpec",
    "AgentUnavailableError",
    "ToolInfo",
    "UnknownAgentError",
    "build_agent",
    "build_app",
    "describe",
    "fingerprint",
    "get_agent_spec",
    "run_scripts",
    "runnable_agents",
    "uses_scripted_model",
    "validate_params",
    "workflow_fingerprint_of",
]


class LoadedAgents(MutableMapping[str, AgentSpec]):
    """The agents of `AGENTS_DIR`, loaded the first time anything asks, then kept for the process.

    Writable so that tests can register an agent built in code (`monkeypatch.setitem`).
    """

    def __init__(self) -> None:
        self._specs: dict[str, AgentSpec] | None = None
        self._lock = threading.Lock()

    def load(self) -> dict[str, AgentSpec]:
        specs = self._specs
        if specs is None:
            with self._lock:
                if self._specs is None:
                    self._specs = load_agents(settings.AGENTS_DIR)
                specs = self._specs
        return specs

    def reload(self) -> dict[str, AgentSpec]:
        """Load `AGENTS_DIR` again (tests that point it elsewhere)."""
        with self._lock:
            self._specs = load_agents(settings.AGENTS_DIR)
            return self._specs

    def __getitem__(self, name: str) -> AgentSpec:
        return self.load()[name]

    def __setitem__(self, name: str, spec: AgentSpec) -> None:
        self.load()[name] = spec

    def __delitem__(self, name: str) -> None:
        del self.load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict(self.load()))

    def __len__(self) -> int:
        return len(self.load())


AGENTS = LoadedAgents()


def runnable_agents() -> list[str]:
    return sorted(name for name, spec in AGENTS.items() if not spec.load_error)


class UnknownAgentError(LookupError):
    def __init__(self, name: str, message: str | None = None):
        self.name = name
        known = ", ".join(runnable_agents()) or "none"
        super().__init__(message or f"There is no agent named {name!r}. Registered agents: {known}.")


class AgentUnavailableError(UnknownAgentError):
    """The package exists but did not load: nothing of it can run."""

    def __init__(self, spec: AgentSpec):
        super().__init__(spec.name, f"The agent {spec.name!r} could not be loaded: {spec.load_error}")


def get_agent_spec(name: str) -> AgentSpec:
    spec = AGENTS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise UnknownAgentError(name)
    if spec.load_error:
        raise AgentUnavailableError(spec)
    return spec


# --- Scripts for the offline model --------------------------------------------------------------


def _names(names: Any) -> str:
    return ", ".join(sorted(names)) or "none"


def validate_agent_script(node: AgentNode, script: Any, *, faults_enabled: bool | None = None) -> None:
    """One agent's script: its steps, the tools that agent has, the agents it may transfer to."""
    validate_script(
        script,
        tool_names=node.script_tool_names,
        transfer_targets=node.transfer_targets,
        faults_enabled=settings.SCRIPTED_FAULTS_ENABLED if faults_enabled is None else faults_enabled,
    )


def refuse_nothing_to_play(spec: AgentSpec, params: dict) -> None:
    """Offline, an agent with no script would answer at once that it has nothing to add: refused.

    The root needs a script when it has a model (it speaks first); a root without one (a
    Sequential/Parallel/Loop agent) needs one for at least one agent of its tree.
    """
    scripts = run_scripts(spec, params)
    root = spec.tree
    if root is None or (scripts.get(root.name) if root.is_llm else any(scripts.values())):
        return
    if spec.default_script or spec.default_scripts:
        # The package has the demo's script, but this deployment does not play demos.
        default = "its DEFAULT_SCRIPT is played only with SCRIPTED_DEFAULT_SCRIPTS=true (off without DEBUG)"
    else:
        default = "add DEFAULT_SCRIPT to the package"
    raise ScriptError(
        f"The agent {spec.name!r} has no script to play: the offline scripted model (AGENT_MODEL=scripted) "
        f"plays one per run. Give params.script (or params.scripts by agent name), {default}, or set "
        f"GOOGLE_API_KEY to run its own model."
    )


def validate_params(spec: AgentSpec, params: dict) -> None:
    """Raise ScriptError (a ValueError) naming `params.script…` if the run's scripts cannot be played.

    `params.script` is the root agent's script; `params.scripts` gives a script to any LlmAgent
    of the tree by name. With a real model both are ignored, and so not checked.
    """
    if not uses_scripted_model():
        return
    agents = spec.llm_agents
    root = spec.tree
    if "script" in params:
        if root is None or not root.is_llm:
            raise ScriptError(
                f"params.script: the root of {spec.name!r} is a {root.kind if root else 'missing agent'}, which has "
                f"no model; give params.scripts, a script per agent name (it has {_names(agents)})."
            )
        try:
            validate_agent_script(root, params["script"])
        except ScriptError as exc:
            raise ScriptError(f"params.script: {exc}") from None
    if "scripts" in params:
        scripts = params["scripts"]
        if not isinstance(scripts, dict):
            raise ScriptError("params.scripts must be an object: {agent name: script}.")
        for agent_name, script in scripts.items():
            node = agents.get(agent_name)
            if node is None:
                raise ScriptError(
                    f"params.scripts names the agent {agent_name!r}, which is not a model-driven agent of "
                    f"{spec.name!r} (it has {_names(agents)})."
                )
            try:
                validate_agent_script(node, script)
            except ScriptError as exc:
                raise ScriptError(f"params.scripts.{agent_name}: {exc}") from None
    refuse_nothing_to_play(spec, params)
    scripts = {"params.script": params.get("script")}
    if isinstance(params.get("scripts"), dict):
        scripts.update({f"params.scripts.{name}": script for name, script in params["scripts"].items()})
    refuse_repeated_call_ids(scripts)


# --- Building a run's tree ----------------------------------------------------------------------


def build_agent(spec: AgentSpec, *, params: dict, positions: dict[str, ScriptPosition] | None = None) -> BaseAgent:
    """The run's own wrapped copy of the agent tree (see `agents.run_tree`); `positions`: a resume's."""
    if spec.root is None:
        raise AgentUnavailableError(spec)
    return build_run_tree(spec, params=params, positions=positions)


def fingerprint(spec: AgentSpec) -> str:
    """The agent's definition as loaded in this process (`agents.fingerprint`)."""
    if spec.root is None:
        raise AgentUnavailableError(spec)
    return agent_fingerprint(spec.root, trusted_servers=settings.MCP_TRUSTED_SERVERS)


def workflow_fingerprint_of(snapshot: dict) -> str:
    """A workflow's stored graph and the agents it runs, as loaded in this process."""
    return workflow_fingerprint(
        snapshot,
        agent_root=lambda name: get_agent_spec(name).root,
        trusted_servers=settings.MCP_TRUSTED_SERVERS,
    )


def build_app(spec: AgentSpec, *, root: Any, name: str, plugins: list) -> App:
    """The run's App: the package's own App (its plugins and configs kept) or a plain one."""
    if spec.app is not None and root is not None and spec.root is not None:
        return spec.app.model_copy(update={"name": name, "root_agent": root, "plugins": [*spec.app.plugins, *plugins]})
    return App(name=name, root_agent=root, plugins=plugins)

