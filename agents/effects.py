"""What a tool does to the world, declared where the tool is written.

Every tool has one effect class:

- `read_only`: it touches nothing in the world; running it again is harmless.
- `idempotent`: doing it again under the same key has no new effect, because Agent Ledger
  deduplicates it by a key built from stable intent (the run's intent, the tool and the business
  key the declaration picks from the call's arguments).
- `effectful`: the default, and what "unknown" means.

This module imports neither Django nor ADK, so an agent package that declares its tools with it
still runs unchanged under `adk web`; the declaration is only an attribute on the function.

    @read_only
    async def lookup_customer(email: str) -> dict: ...

    @idempotent(key="to", stable=("subject",))
    async def send_email(to: str, subject: str, body: str) -> dict: ...

`key` names the arguments that identify the effect (or is a callable over the arguments that
returns a JSON value); `stable` names arguments that must agree for a repeated call to be the
same effect (a repeated key with other stable fields is refused, never silently deduplicated).
Arguments the model writes freely (an email's body, a note's wording) belong in neither.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

READ_ONLY = "read_only"
IDEMPOTENT = "idempotent"
EFFECTFUL = "effectful"
EFFECT_CLASSES = (READ_ONLY, IDEMPOTENT, EFFECTFUL)

DECLARED = "declared where the tool is written"

# The attribute the decorators set on the function (and that a package may set by hand).
ATTRIBUTE = "agent_ledger_effect"

KeySpec = tuple[str, ...] | Callable[[Mapping[str, Any]], Any]


class EffectDeclarationError(ValueError):
    """A declaration that cannot work, said when the module defining the tool is imported."""


class KeyArgumentMissing(ValueError):
    """The call lacks an argument its idempotency key is built from."""


@dataclass(frozen=True)
class Effect:
    """One tool's effect class and, for an idempotent tool, how its business key is picked."""

    kind: str = EFFECTFUL
    key: KeySpec | None = None
    stable: tuple[str, ...] = ()
    # Why the tool has this class, for people (the API and the admin show it beside the class).
    source: str = "not declared: effectful, the default"
    # An idempotent tool the ledger can deduplicate (an MCP server's hint has no key: the server
    # promises that the same arguments have no new effect, and the ledger cannot do better).
    keyed: bool = field(default=False)

    def business_key(self, args: Mapping[str, Any]) -> Any:
        """The business key of one call, as a JSON value; raises KeyArgumentMissing."""
        if self.key is None:
            raise KeyArgumentMissing("This tool declares no idempotency key.")
        if callable(self.key):
            value = self.key(args)
        else:
            missing = [name for name in self.key if name not in args]
            if missing:
                raise KeyArgumentMissing(f"The call has no {', '.join(missing)} argument to build its key from.")
            value = {name: normalise(args[name]) for name in self.key}
        return json.loads(json.dumps(value, sort_keys=True, default=str))

    def stable_fields(self, args: Mapping[str, Any]) -> dict[str, Any]:
        return {name: normalise(args.get(name)) for name in self.stable}


def normalise(value: Any) -> Any:
    """How a key or stable argument compares: case and runs of whitespace do not make a new effect."""
    if isinstance(value, str):
        return " ".join(value.split()).casefold()
    return value


def _names(names: str | Iterable[str], what: str) -> tuple[str, ...]:
    result = (names,) if isinstance(names, str) else tuple(names)
    if not result or not all(isinstance(name, str) and name for name in result):
        raise EffectDeclarationError(f"{what} must name at least one argument.")
    return result


def read_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Declare that `fn` touches nothing in the world."""
    setattr(fn, ATTRIBUTE, Effect(READ_ONLY, source=DECLARED))
    return fn


def idempotent(
    *, key: str | Iterable[str] | Callable[[Mapping[str, Any]], Any], stable: str | Iterable[str] = ()
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare that `fn` is deduplicated by a key from stable intent (see the module's docstring)."""
    key_spec: KeySpec = key if callable(key) else _names(key, "key")
    stable_names = () if stable == () else _names(stable, "stable")
    if not callable(key_spec) and set(key_spec) & set(stable_names):
        raise EffectDeclarationError("An argument is either part of the key or a stable field, not both.")

    def declare(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, ATTRIBUTE, Effect(IDEMPOTENT, key=key_spec, stable=stable_names, source=DECLARED, keyed=True))
        return fn

    return declare


def effect_of_function(fn: Any) -> Effect:
    declared = getattr(fn, ATTRIBUTE, None)
    if isinstance(declared, Effect):
        return declared
    if isinstance(declared, str) and declared in (READ_ONLY, EFFECTFUL):
        return Effect(declared, source=DECLARED)
    return Effect()


# --- Any tool object, read at call time --------------------------------------------------------


def mcp_server_names(tool: Any) -> set[str]:
    """The names a deployment may use for the MCP server behind an ADK McpTool.

    ADK keeps the connection parameters on the tool's session manager (private attributes), so
    each is read defensively: a stdio server's command line and the script or package it starts,
    another server's URL, and the toolset's name prefix if it has one.
    """
    names: set[str] = set()
    manager = getattr(tool, "_mcp_session_manager", None)
    params = getattr(manager, "_connection_params", None)
    server = getattr(params, "server_params", None) or params
    command = getattr(server, "command", None)
    if isinstance(command, str) and command:
        args = [arg for arg in (getattr(server, "args", None) or []) if isinstance(arg, str)]
        # The whole command line, and the script or package it starts; never the bare launcher
        # (trusting "npx" or "python" would trust every server it can start).
        names.add(" ".join([command, *args]))
        target = next((arg for arg in args if not arg.startswith("-")), None)
        if target:
            names.add(target)
    url = getattr(params, "url", None)
    if isinstance(url, str) and url:
        names.add(url)
    for attribute in ("tool_name_prefix", "_tool_name_prefix", "server_name"):
        value = getattr(tool, attribute, None)
        if isinstance(value, str) and value:
            names.add(value)
    return names


def _hint(annotations: Any, snake: str, camel: str) -> bool | None:
    """A hint as the server sent it: true, false, or None when it sent none."""
    if annotations is None:
        return None
    if isinstance(annotations, Mapping):
        value = annotations.get(camel, annotations.get(snake))
    else:
        value = getattr(annotations, snake, getattr(annotations, camel, None))
    return value if isinstance(value, bool) else None


def _annotation(annotations: Any, snake: str, camel: str) -> bool:
    return _hint(annotations, snake, camel) is True


MCP_HINTS = (("read_only_hint", "readOnlyHint"), ("idempotent_hint", "idempotentHint"))


def _hints_sent(annotations: Any) -> str:
    """What the server said of both hints, in its own terms: `readOnlyHint=false, no idempotentHint`."""
    said = []
    for snake, camel in MCP_HINTS:
        value = _hint(annotations, snake, camel)
        said.append(f"no {camel}" if value is None else f"{camel}={str(value).lower()}")
    return ", ".join(said)


def effect_of_mcp_tool(tool: Any, *, trusted_servers: Collection[str]) -> Effect:
    """An MCP tool's hints count only when its server is one the deployment trusts."""
    raw = getattr(tool, "raw_mcp_tool", None)
    annotations = getattr(raw, "annotations", None)
    names = mcp_server_names(tool)
    trusted = sorted(names & set(trusted_servers))
    hints = [camel for snake, camel in MCP_HINTS if _annotation(annotations, snake, camel)]
    if not trusted:
        if hints:
            return Effect(source=f"the server's {' and '.join(hints)} ignored: the server is not in MCP_TRUSTED_SERVERS")
        return Effect(source=f"an MCP server's tool ({_hints_sent(annotations)}): effectful, the default")
    if _annotation(annotations, "read_only_hint", "readOnlyHint"):
        return Effect(READ_ONLY, source="readOnlyHint of a server in MCP_TRUSTED_SERVERS")
    if _annotation(annotations, "idempotent_hint", "idempotentHint"):
        return Effect(IDEMPOTENT, source="idempotentHint of a server in MCP_TRUSTED_SERVERS")
    return Effect(source=f"a server in MCP_TRUSTED_SERVERS that sent {_hints_sent(annotations)}: effectful, the default")


# ADK's own tools that only read the agent's long-term memory (by class name: no ADK import here).
READ_ONLY_BUILTINS = frozenset({"PreloadMemoryTool", "LoadMemoryTool", "PreloadMemoryOncePerInvocation"})
MEMORY_READ = "ADK's memory read: it only reads the agent's long-term memory"

# ADK's control tools act on the run, never on the world: a hand-off between agents, leaving a
# loop, asking the user (a confirmation, a credential, an answer) and waiting. Keyed by the module
# that defines the function (a package's own function of the same name is not one of them) and
# by ADK's class name.
CONTROL_FUNCTIONS = {
    "google.adk.tools.transfer_to_agent_tool": "ADK's hand-off between agents: it acts on nothing outside",
    "google.adk.tools.exit_loop_tool": "ADK's exit from a LoopAgent: it acts on nothing outside",
    "google.adk.tools.get_user_choice_tool": "ADK's question to the user: it waits and acts on nothing outside",
    "google.adk.tools._request_input_tool": "ADK's question to the user: it waits and acts on nothing outside",
    "google.adk.tools.load_memory_tool": MEMORY_READ,
    "google.adk.tools.preload_memory_tool": MEMORY_READ,
}
CONTROL_CLASSES = {"TransferToAgentTool": CONTROL_FUNCTIONS["google.adk.tools.transfer_to_agent_tool"]}
# Calls ADK writes into a run's events that no tool of the agent answers: a transfer (the tool is
# added by ADK's flow, not held by the agent) and the confirmation and long-running plumbing.
CONTROL_CALL_NAMES = {
    "transfer_to_agent": CONTROL_FUNCTIONS["google.adk.tools.transfer_to_agent_tool"],
    "adk_request_confirmation": "ADK's request for a person's confirmation: it waits and acts on nothing outside",
    "adk_request_credential": "ADK's request for the user's credential: it waits and acts on nothing outside",
    "adk_request_input": "ADK's question to the user: it waits and acts on nothing outside",
}


def effect_of_call_name(name: str) -> Effect | None:
    """The effect of a call ADK itself makes (no tool of the agent behind it), or None."""
    reason = CONTROL_CALL_NAMES.get(name)
    return Effect(READ_ONLY, source=reason) if reason else None


def _control_effect(tool: Any) -> Effect | None:
    reason = CONTROL_CLASSES.get(type(tool).__name__)
    func = getattr(tool, "func", tool)
    reason = reason or CONTROL_FUNCTIONS.get(getattr(func, "__module__", None) or "")
    return Effect(READ_ONLY, source=reason) if reason else None


def effect_of_tool(tool: Any, *, trusted_servers: Collection[str] = ()) -> Effect:
    """The effect class of whatever an agent holds as a tool: a function, a FunctionTool, an McpTool…

    Anything else (an agent used as a tool, a toolset's tool of unknown kind) is `effectful`.
    """
    if hasattr(tool, "raw_mcp_tool"):
        return effect_of_mcp_tool(tool, trusted_servers=trusted_servers)
    declared = getattr(tool, ATTRIBUTE, None)
    if declared is not None:
        return effect_of_function(tool)
    control = _control_effect(tool)
    if control is not None:
        return control
    if type(tool).__name__ in READ_ONLY_BUILTINS:
        return Effect(kind=READ_ONLY, source=MEMORY_READ)
    func = getattr(tool, "func", None)
    if func is not None:
        return effect_of_function(func)
    return Effect()


def tool_name(tool: Any) -> str | None:
    """The name the model calls a tool by (ADK names a plain function after itself)."""
    name = getattr(tool, "name", None)
    if isinstance(name, str) and name:
        return name
    if callable(tool):
        return getattr(tool, "__name__", None)
    return None
