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
    # Where the class came from, for people: "declared", "default", "mcp hint (trusted: …)".
    source: str = "default"
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
    setattr(fn, ATTRIBUTE, Effect(READ_ONLY, source="declared"))
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
        setattr(fn, ATTRIBUTE, Effect(IDEMPOTENT, key=key_spec, stable=stable_names, source="declared", keyed=True))
        return fn

    return declare


def effect_of_function(fn: Any) -> Effect:
    declared = getattr(fn, ATTRIBUTE, None)
    if isinstance(declared, Effect):
        return declared
    if isinstance(declared, str) and declared in (READ_ONLY, EFFECTFUL):
        return Effect(declared, source="declared")
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


def _annotation(annotations: Any, snake: str, camel: str) -> bool:
    if annotations is None:
        return False
    if isinstance(annotations, Mapping):
        return annotations.get(camel, annotations.get(snake)) is True
    return getattr(annotations, snake, getattr(annotations, camel, None)) is True


def effect_of_mcp_tool(tool: Any, *, trusted_servers: Collection[str]) -> Effect:
    """An MCP tool's hints count only when its server is one the deployment trusts."""
    raw = getattr(tool, "raw_mcp_tool", None)
    annotations = getattr(raw, "annotations", None)
    names = mcp_server_names(tool)
    trusted = sorted(names & set(trusted_servers))
    if not trusted:
        hinted = _annotation(annotations, "read_only_hint", "readOnlyHint")
        return Effect(source="mcp server not trusted (hints ignored)" if hinted else "default")
    source = f"mcp hint (trusted: {trusted[0]})"
    if _annotation(annotations, "read_only_hint", "readOnlyHint"):
        return Effect(READ_ONLY, source=source)
    if _annotation(annotations, "idempotent_hint", "idempotentHint"):
        return Effect(IDEMPOTENT, source=source)
    return Effect(source=source)


# ADK's own tools that only read the agent's long-term memory (by class name: no ADK import here).
READ_ONLY_BUILTINS = frozenset({"PreloadMemoryTool", "LoadMemoryTool", "PreloadMemoryOncePerInvocation"})


def effect_of_tool(tool: Any, *, trusted_servers: Collection[str] = ()) -> Effect:
    """The effect class of whatever an agent holds as a tool: a function, a FunctionTool, an McpTool…

    Anything else (an agent used as a tool, a toolset's tool of unknown kind) is `effectful`.
    """
    if hasattr(tool, "raw_mcp_tool"):
        return effect_of_mcp_tool(tool, trusted_servers=trusted_servers)
    declared = getattr(tool, ATTRIBUTE, None)
    if declared is not None:
        return effect_of_function(tool)
    func = getattr(tool, "func", None)
    if func is not None:
        return effect_of_function(func)
    if type(tool).__name__ in READ_ONLY_BUILTINS:
        return Effect(kind=READ_ONLY, source="ADK built-in that only reads memory")
    return Effect()


def tool_name(tool: Any) -> str | None:
    """The name the model calls a tool by (ADK names a plain function after itself)."""
    name = getattr(tool, "name", None)
    if isinstance(name, str) and name:
        return name
    if callable(tool):
        return getattr(tool, "__name__", None)
    return None
