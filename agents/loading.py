"""Agent packages from the agents directories, loaded by ADK's own loader and described.

Each directory of `AGENTS_DIR` is laid out the way `adk web` expects; ADK's `AgentLoader` imports
each package by its folder name, and the folder name is the agent's name. A package that fails
to import is kept with its error, so it is listed (start-up log, API, admin) and the others run.

The description (`AgentSpec`) is what the ledger needs without running anything: the tree of
agents, each agent's tools with their source (function, MCP server, agent-as-tool), who each
agent may transfer to, and the scripts the package offers to the offline model. An MCP server's
tools are listed by asking it, once, within `AGENT_TOOL_LISTING_TIMEOUT_SECONDS`; a server that
does not answer in time leaves a tool-listing error on its agent, never a hung start-up.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import copy
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from google.adk.agents import BaseAgent, LlmAgent
from google.adk.apps import App
from google.adk.cli.utils.agent_loader import AgentLoader
from google.adk.flows.llm_flows.agent_transfer import _get_transfer_targets
from google.adk.tools.agent_tool import AgentTool
from google.adk.tools.base_tool import BaseTool
from google.adk.tools.base_toolset import BaseToolset

from agents import redaction
from agents.effects import effect_of_tool
from agents.scripted import TRANSFER_TOOL

logger = logging.getLogger(__name__)


# Sources of a tool, as the API and the admin show them.
FUNCTION, MCP, AGENT, BUILTIN, TOOLSET = "function", "mcp", "agent", "builtin", "toolset"


@dataclass(frozen=True)
class ToolInfo:
    name: str
    source: str
    # The MCP server's command line (or URL), or the wrapped agent's name.
    detail: str = ""
    # The tool's effect class (agents.effects): read_only, idempotent or effectful (the default).
    effect: str = "effectful"
    # What an MCP server says about the tool (readOnlyHint, destructiveHint, …).
    annotations: dict = field(default_factory=dict)
    # Why it has that class: declared, the default, an MCP hint trusted or ignored, ADK's own tool.
    effect_reason: str = ""
    # `detail` as people who may not configure agents see it (agents.redaction).
    public_detail: str = ""

    @property
    def shown_detail(self) -> str:
        return self.public_detail or self.detail


@dataclass(frozen=True)
class AgentNode:
    """One agent of a tree: its tools, its sub-agents and the agents its tools wrap."""

    name: str
    kind: str
    description: str = ""
    tools: tuple[ToolInfo, ...] = ()
    sub_agents: tuple[AgentNode, ...] = ()
    # Agents wrapped by an AgentTool of this agent: they run inside the tool's call.
    tool_agents: tuple[AgentNode, ...] = ()
    transfer_targets: tuple[str, ...] = ()
    tool_errors: tuple[str, ...] = ()
    # The same errors without the servers' arguments, URLs or folders (agents.redaction).
    public_tool_errors: tuple[str, ...] = ()

    @property
    def is_llm(self) -> bool:
        return self.kind == "LlmAgent"

    def walk(self) -> Iterator[AgentNode]:
        yield self
        for child in (*self.sub_agents, *self.tool_agents):
            yield from child.walk()

    @property
    def script_tool_names(self) -> list[str] | None:
        """What a script step may call on this agent; None when a toolset could not be listed."""
        if self.tool_errors:
            return None
        names = [tool.name for tool in self.tools if tool.source != BUILTIN or tool.name != "preload_memory"]
        if self.transfer_targets:
            names.append(TRANSFER_TOOL)
        return names


@dataclass(frozen=True)
class AgentSpec:
    """A loaded agent package, as the ledger knows it."""

    name: str
    description: str = ""
    # The loaded definition: shared by every run, never changed (each run builds its own copy).
    root: BaseAgent | None = None
    app: App | None = None
    tree: AgentNode | None = None
    # The offline model's default script for the root agent, and per agent name.
    default_script: tuple = ()
    default_scripts: dict = field(default_factory=dict)
    load_error: str = ""
    path: str = ""

    @property
    def tools(self) -> tuple[ToolInfo, ...]:
        return self.tree.tools if self.tree else ()

    @property
    def tool_names(self) -> list[str]:
        return [tool.name for tool in self.tools]

    @property
    def llm_agents(self) -> dict[str, AgentNode]:
        """Every LlmAgent of the tree by name: the agents a script can address."""
        return {node.name: node for node in self.tree.walk() if node.is_llm} if self.tree else {}

    @property
    def tool_errors(self) -> list[str]:
        return [error for node in self.tree.walk() for error in node.tool_errors] if self.tree else []

    @property
    def public_tool_errors(self) -> list[str]:
        """The tool errors as people who may not configure agents read them: what the logs say too."""
        return [error for node in self.tree.walk() for error in node.public_tool_errors] if self.tree else []


# --- Describing an agent tree -------------------------------------------------------------------


def tool_agent(tool: Any) -> BaseAgent | None:
    return tool.agent if isinstance(tool, AgentTool) else None


def child_agents(agent: BaseAgent) -> list[BaseAgent]:
    """Every agent directly inside `agent`: its sub-agents, then the agents its AgentTools wrap."""
    wrapped = [tool.agent for tool in getattr(agent, "tools", None) or [] if isinstance(tool, AgentTool)]
    return [*agent.sub_agents, *wrapped]


def walk_agents(root: BaseAgent) -> Iterator[BaseAgent]:
    yield root
    for child in child_agents(root):
        yield from walk_agents(child)


def mcp_server_command(toolset: Any, *, public: bool = False) -> str:
    """The server's command line or URL; `public`: as people who may not configure agents see it."""
    params = getattr(toolset, "_connection_params", None)
    server = getattr(params, "server_params", params)
    command = getattr(server, "command", None)
    if command:
        args = [str(arg) for arg in getattr(server, "args", None) or []]
        return redaction.public_command(str(command), args) if public else " ".join([str(command), *args])
    url = str(getattr(server, "url", "") or "")
    if url:
        return redaction.public_url(url) if public else url
    return type(params).__name__


def per_run_mcp_toolset(toolset: Any) -> Any:
    """A copy of an McpToolset with its own MCP session (and tool-list cache).

    ADK's Runner closes every toolset of its tree when it closes, and an MCP session belongs to
    the event loop that opened it; a copy per run (or per listing) keeps a run's closing from
    cutting another run's session, and the loaded toolset is never touched.
    """
    clone = copy.copy(toolset)
    # The loaded toolset's own session manager class: naming ADK's would import MCP here.
    clone._mcp_session_manager = type(toolset._mcp_session_manager)(
        connection_params=toolset._connection_params,
        errlog=toolset._errlog,
        sampling_callback=toolset._sampling_callback,
        sampling_capabilities=toolset._sampling_capabilities,
        elicitation_callback=toolset._elicitation_callback,
    )
    clone._tool_list_cache = collections.OrderedDict()
    return clone


# ADK's MCP support (and the `mcp` package under it) takes about as long to import as the rest of
# ADK; it is loaded only by an agent package that uses it, so every process pays for it only then.
_MCP_TOOLSET_MODULE = "google.adk.tools.mcp_tool.mcp_toolset"


def is_mcp_toolset(tool: Any) -> bool:
    # No agent imported ADK's MCP toolset: no tool can be one.
    module = sys.modules.get(_MCP_TOOLSET_MODULE)
    return module is not None and isinstance(tool, module.McpToolset)


def list_mcp_tools(toolset: Any, *, timeout: float) -> list[ToolInfo]:
    """Ask an MCP server for its tools, on a loop and thread of its own, within `timeout`.

    Raises TimeoutError or the server's error. Its own thread and loop, because the registry may
    first be read from inside a running loop (the ASGI server's, the agent loop).
    """
    command = mcp_server_command(toolset)
    public = mcp_server_command(toolset, public=True)

    async def listing() -> list[ToolInfo]:
        probe = per_run_mcp_toolset(toolset)
        try:
            tools = await asyncio.wait_for(probe.get_tools(), timeout=timeout)
        finally:
            try:
                await asyncio.wait_for(probe.close(), timeout=5)
            except Exception:  # noqa: BLE001 - a server that will not close is not the agent's error
                logger.warning("The MCP server %s did not close cleanly after listing its tools", public)
        infos = []
        for tool in tools:
            annotations = getattr(getattr(tool, "raw_mcp_tool", None), "annotations", None)
            effect = effect_of_tool(tool, trusted_servers=settings.MCP_TRUSTED_SERVERS)
            infos.append(
                ToolInfo(
                    name=tool.name,
                    source=MCP,
                    detail=command,
                    public_detail=public,
                    effect=effect.kind,
                    effect_reason=effect.source,
                    annotations=annotations.model_dump(by_alias=True, exclude_none=True) if annotations else {},
                )
            )
        return infos

    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mcp-listing") as pool:
        future = pool.submit(asyncio.run, listing())
        return future.result(timeout=timeout + 10)


def _effect_info(tool: Any, **fields: Any) -> ToolInfo:
    effect = effect_of_tool(tool)
    return ToolInfo(effect=effect.kind, effect_reason=effect.source, **fields)


def _describe_tool(tool: Any, *, timeout: float) -> tuple[list[ToolInfo], str, str]:
    """(the tool's entries, an error or "", the error as people who may not configure agents see it)."""
    if isinstance(tool, AgentTool):
        return [ToolInfo(name=tool.name, source=AGENT, detail=tool.agent.name,
                         effect_reason="an agent used as a tool: effectful, as its own tools may be")], "", ""
    if is_mcp_toolset(tool):
        command, public = mcp_server_command(tool), mcp_server_command(tool, public=True)
        try:
            return list_mcp_tools(tool, timeout=timeout), "", ""
        except (TimeoutError, concurrent.futures.TimeoutError):
            error = f"The MCP server {command} did not list its tools within {timeout:g} s."
        except Exception as exc:  # noqa: BLE001 - any failure of a server is reported, not raised
            error = f"The MCP server {command} could not list its tools: {type(exc).__name__}: {exc}"
        return [], error, redaction.public_text(error, replacements={command: public})
    if isinstance(tool, BaseToolset):
        error = f"The toolset {type(tool).__name__} is not listed here; its tools are known only when it runs."
        return [], error, error
    if isinstance(tool, BaseTool):
        source = FUNCTION if type(tool).__name__ in ("FunctionTool", "LongRunningFunctionTool") else BUILTIN
        return [_effect_info(tool, name=tool.name, source=source)], "", ""
    if callable(tool):
        return [_effect_info(tool, name=getattr(tool, "__name__", repr(tool)), source=FUNCTION)], "", ""
    error = f"The tool {tool!r} is of an unknown kind."
    return [], error, redaction.public_text(error)


def describe_agent(agent: BaseAgent, *, timeout: float) -> AgentNode:
    tools: list[ToolInfo] = []
    errors: list[str] = []
    public_errors: list[str] = []
    for tool in getattr(agent, "tools", None) or []:
        infos, error, public_error = _describe_tool(tool, timeout=timeout)
        tools.extend(infos)
        if error:
            errors.append(f"{agent.name}: {error}")
            public_errors.append(f"{agent.name}: {public_error}")
    return AgentNode(
        name=agent.name,
        kind=type(agent).__name__,
        description=agent.description or "",
        tools=tuple(tools),
        sub_agents=tuple(describe_agent(child, timeout=timeout) for child in agent.sub_agents),
        tool_agents=tuple(
            describe_agent(tool.agent, timeout=timeout)
            for tool in getattr(agent, "tools", None) or []
            if isinstance(tool, AgentTool)
        ),
        transfer_targets=tuple(target.name for target in _get_transfer_targets(agent)) if isinstance(agent, LlmAgent) else (),
        tool_errors=tuple(errors),
        public_tool_errors=tuple(public_errors),
    )


def _tree_problems(root: BaseAgent) -> list[str]:
    names = [agent.name for agent in walk_agents(root)]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        # Scripts and the journal address agents by name: each name must be one agent.
        return [f"The agent tree uses the name(s) {', '.join(duplicated)} more than once."]
    return []


def describe(
    name: str,
    loaded: BaseAgent | App,
    *,
    default_script: Iterable = (),
    default_scripts: dict | None = None,
    path: str = "",
    timeout: float | None = None,
) -> AgentSpec:
    """The ledger's description of a loaded agent (or App) called `name`."""
    timeout = settings.AGENT_TOOL_LISTING_TIMEOUT_SECONDS if timeout is None else timeout
    app = loaded if isinstance(loaded, App) else None
    root = app.root_agent if app is not None else loaded
    if not isinstance(root, BaseAgent):
        # A Workflow root is a graph of nodes, not a tree of agents: there is no agent tree to
        # wrap and script, so it is listed and refused rather than run half-wrapped.
        return AgentSpec(
            name=name,
            path=path,
            load_error=f"The root is a {type(root).__name__}; Agent Ledger runs trees of ADK agents (BaseAgent).",
        )
    problems = _tree_problems(root)
    return AgentSpec(
        name=name,
        description=root.description or "",
        root=root,
        app=app,
        tree=describe_agent(root, timeout=timeout),
        default_script=tuple(default_script or ()),
        default_scripts=dict(default_scripts or {}),
        load_error=" ".join(problems),
        path=path,
    )


# --- Loading the agents directories -------------------------------------------------------------


def _package_module(name: str) -> Any:
    return sys.modules.get(f"{name}.agent") or sys.modules.get(name)


def _package_scripts(name: str) -> tuple[list, dict]:
    module = _package_module(name)
    script = getattr(module, "DEFAULT_SCRIPT", None)
    scripts = getattr(module, "DEFAULT_SCRIPTS", None)
    return (list(script) if isinstance(script, list | tuple) else []), (dict(scripts) if isinstance(scripts, dict) else {})


def _error_text(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    text = f"{type(cause).__name__}: {cause}"
    if isinstance(cause, SystemExit):
        text = f"SystemExit: the package called sys.exit({cause.code!r}) while being imported"
    if isinstance(cause, SyntaxError) and cause.filename:
        text = f"SyntaxError: {cause.msg} ({cause.filename}, line {cause.lineno})"
    return text


# ADK's loader reads a `.env` from each package's folder upwards (to `/`) into the process
# environment unless this is set; it reads the variable at each load.
ADK_DOTENV_SWITCH = "ADK_DISABLE_LOAD_DOTENV"


@contextlib.contextmanager
def dotenv_policy(*, load_dotenv: bool) -> Iterator[None]:
    """ADK's `.env` loading as the deployment says (`AGENTS_LOAD_DOTENV`), for the loads inside.

    Off by default: a `.env` anywhere above a package would otherwise rewrite this process's
    settings (and those of the web server and workers `serve` starts after loading). The
    variable is put back as it was, so nothing outside the loads sees a change.
    """
    before = os.environ.get(ADK_DOTENV_SWITCH)
    os.environ[ADK_DOTENV_SWITCH] = "false" if load_dotenv else "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ADK_DOTENV_SWITCH, None)
        else:
            os.environ[ADK_DOTENV_SWITCH] = before


def _import_package(loader: AgentLoader, name: str) -> tuple[Any, str]:
    """(the loaded agent or App, "") or (None, the error): whatever the package raises at import.

    BaseException, not Exception: a package that calls sys.exit() or raises KeyboardInterrupt
    while being imported is a broken package, not a reason for the server to stop.
    """
    try:
        return loader.load_agent(name), ""
    except BaseException as exc:  # noqa: BLE001 - one broken package must not take the others down
        return None, _error_text(exc)


def load_directory(directory: str | Path, *, skip: Iterable[str] = ()) -> list[AgentSpec]:
    """Every agent package of one directory, loaded by ADK's AgentLoader; failures kept as errors."""
    path = Path(directory)
    if not path.is_dir():
        return [AgentSpec(name=path.name or str(path), path=str(path), load_error=f"AGENTS_DIR entry {path} is not a directory.")]
    loader = AgentLoader(str(path))
    skip = set(skip)
    specs = []
    for name in loader.list_agents():
        package_path = str(Path(loader.agents_dir) / name)
        if name in skip:
            specs.append(
                AgentSpec(name=name, path=package_path, load_error=f"An agent named {name!r} was already loaded from an earlier AGENTS_DIR entry.")
            )
            continue
        with dotenv_policy(load_dotenv=settings.AGENTS_LOAD_DOTENV):
            loaded, error = _import_package(loader, name)
        if error:
            specs.append(AgentSpec(name=name, path=package_path, load_error=error))
            continue
        script, scripts = _package_scripts(name)
        specs.append(describe(name, loaded, default_script=script, default_scripts=scripts, path=package_path))
    return specs


def load_agents(directories: Iterable[str | Path]) -> dict[str, AgentSpec]:
    specs: dict[str, AgentSpec] = {}
    for directory in directories:
        for spec in load_directory(directory, skip=[name for name, spec in specs.items() if not spec.load_error]):
            if spec.name in specs and not specs[spec.name].load_error:
                # The first directory that has the name wins; the clash is logged, not listed.
                logger.error("Agent %s in %s: %s", spec.name, spec.path, spec.load_error)
                continue
            specs[spec.name] = spec
    for spec in specs.values():
        if spec.load_error:
            logger.error("Agent %s (%s) could not be loaded: %s", spec.name, spec.path, spec.load_error)
        # Logs travel further than the admin: an MCP server's URL (a user and password, a token in
        # its path or query) or command line (an --api-key) is logged as the public form.
        for error in spec.public_tool_errors:
            logger.error("Agent %s: %s", spec.name, error)
    return specs

