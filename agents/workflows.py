"""Workflows: graphs of registered agents and function steps, run on ADK's Workflow primitives.

A definition is stored as JSON (`agents.models.WorkflowDefinition.graph`):

    {
      "steps": {
        "triage":   {"agent": "triage"},
        "billing":  {"agent": "billing"},
        "findings": {"join": true},
        "brief":    {"function": "combine_findings"},
        "support":  {"agent": "support", "retry": {"max_attempts": 2, "initial_delay": 1}}
      },
      "chains": [["START", ["triage", "billing"], "findings", "brief", "support"]]
    }

A chain is ADK's tuple: each element runs after the one before it; a list inside a chain is a
fan-out (its steps run concurrently), and a `join` step waits for every step that leads to it
and hands on `{step: output}`. A step is exactly one of `agent` (a registered agent), `function`
(a registered function step), `join`, or `workflow` (another definition, run as a sub-workflow).

`validate_graph` refuses, naming the problem: unknown agents, functions or workflows, cycles
(in the graph and between workflows), dangling joins, empty graphs, unreachable steps, steps
that several steps lead to without a join, and graphs that end in more than one step.
`compile_workflow` turns a validated snapshot into a `google.adk.workflow.Workflow` whose steps
report their start and end to a recorder (the run's `RunStep` rows).
"""

from __future__ import annotations

import asyncio
import json
import keyword
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from google.adk.workflow import START, BaseNode, FunctionNode, JoinNode, RetryConfig, Workflow
from google.adk.workflow.utils._workflow_graph_utils import build_node
from google.genai import types

from agents.registry import (
    AGENTS,
    UnknownAgentError,
    build_agent,
    get_agent_spec,
    runnable_agents,
    uses_scripted_model,
    validate_agent_script,
)
from agents.scripted import ScriptError, refuse_repeated_call_ids

START_NAME = "START"
MAX_STEPS = 50
MAX_NAME_CHARS = 64
MAX_RETRY_ATTEMPTS = 10
MAX_RETRY_DELAY_SECONDS = 3600.0
MAX_TIMEOUT_SECONDS = 24 * 3600.0
MAX_NESTING = 5
STEP_KINDS = ("agent", "function", "join", "workflow")
STEP_KEYS = set(STEP_KINDS) | {"retry", "timeout"}
RETRY_KEYS = {"max_attempts", "initial_delay", "max_delay"}
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class WorkflowGraphError(ValueError):
    """A definition that cannot run; `problems` lists every sentence naming what is wrong."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(" ".join(self.problems))


# --- Function steps --------------------------------------------------------------------------------


def _text_of(value: Any) -> str:
    if isinstance(value, types.Content):
        return "".join(part.text or "" for part in value.parts or [] if not getattr(part, "thought", False))
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


async def request_text(node_input: Any) -> str:
    """The text of what the workflow was asked (attachments left out)."""
    return _text_of(node_input).strip()


async def combine_findings(node_input: Any) -> str:
    """A join's `{step: output}` as one brief, a paragraph per step, in step-name order."""
    if not isinstance(node_input, dict):
        return _text_of(node_input)
    return "\n\n".join(f"{name}: {_text_of(output).strip()}" for name, output in sorted(node_input.items()))


@dataclass(frozen=True)
class FunctionStep:
    name: str
    description: str
    func: Callable[..., Any]


FUNCTION_STEPS: dict[str, FunctionStep] = {
    step.name: step
    for step in (
        FunctionStep("request_text", "The text of the workflow's input message.", request_text),
        FunctionStep("combine_findings", "A join's outputs as one brief, a paragraph per step.", combine_findings),
    )
}


# --- Validation ------------------------------------------------------------------------------------


def _quote(name: Any) -> str:
    return f"“{name}”"


def _names(names) -> str:
    return ", ".join(sorted(names)) or "none"


def validate_workflow_name(name: Any) -> str:
    """A workflow's name: a Python identifier (ADK's rule for nodes), not an agent's name."""
    if not isinstance(name, str) or not name.strip():
        raise WorkflowGraphError(["The workflow needs a name."])
    name = name.strip()
    if len(name) > MAX_NAME_CHARS:
        raise WorkflowGraphError([f"The name is longer than {MAX_NAME_CHARS} characters."])
    if not _NAME.match(name) or keyword.iskeyword(name) or name == START_NAME or name == "user":
        raise WorkflowGraphError(
            [f"The name {_quote(name)} is not usable: use letters, digits and underscores, starting with a letter."]
        )
    if name in AGENTS:
        raise WorkflowGraphError(
            [f"A registered agent is already called {_quote(name)}: runs name one or the other, so pick another name."]
        )
    return name


def _check_step_name(name: Any) -> str | None:
    if not isinstance(name, str) or not _NAME.match(name) or keyword.iskeyword(name) or len(name) > MAX_NAME_CHARS:
        return (
            f"The step name {_quote(name)} is not usable: use letters, digits and underscores, starting "
            f"with a letter, at most {MAX_NAME_CHARS} characters."
        )
    if name == START_NAME:
        return "START is where every workflow begins; it cannot be the name of a step."
    return None


def _check_number(where: str, key: str, value: Any, *, minimum: float, maximum: float, integer: bool = False) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        kind = "a whole number" if integer else "a number"
        return f"{where}: {key!r} must be {kind}."
    if not minimum <= value <= maximum:
        return f"{where}: {key!r} must be between {minimum:g} and {maximum:g}."
    return None


def _check_step(name: str, spec: Any, workflow_exists: Callable[[str], bool]) -> list[str]:
    where = f"Step {_quote(name)}"
    if not isinstance(spec, dict):
        return [f'{where} must be an object such as {{"agent": "support"}}.']
    problems: list[str] = []
    unknown = sorted(set(spec) - STEP_KEYS)
    if unknown:
        problems.append(f"{where} has unknown key(s) {', '.join(unknown)}; a step has one of {', '.join(STEP_KINDS)}, and optionally retry and timeout.")
    kinds = [kind for kind in STEP_KINDS if kind in spec]
    if len(kinds) != 1:
        problems.append(f"{where} must have exactly one of {', '.join(STEP_KINDS)} (it has {len(kinds)}).")
        return problems
    kind = kinds[0]
    target = spec[kind]
    if kind == "join":
        if target is not True:
            problems.append(f'{where}: a join step is {{"join": true}}.')
    elif not isinstance(target, str) or not target:
        problems.append(f"{where}: {kind!r} must be the name of a registered {kind}.")
    elif kind == "agent" and target not in runnable_agents():
        broken = AGENTS.get(target)
        if broken is not None:
            problems.append(f"{where} uses the agent {_quote(target)}, which could not be loaded: {broken.load_error}")
        else:
            problems.append(
                f"{where} uses the agent {_quote(target)}, which is not registered. "
                f"Registered agents: {_names(runnable_agents())}."
            )
    elif kind == "function" and target not in FUNCTION_STEPS:
        problems.append(
            f"{where} uses the function step {_quote(target)}, which is not registered. "
            f"Registered function steps: {_names(FUNCTION_STEPS)}."
        )
    elif kind == "workflow" and not workflow_exists(target):
        problems.append(f"{where} runs the workflow {_quote(target)}, which does not exist.")
    if "retry" in spec:
        retry = spec["retry"]
        if kind in ("join", "workflow"):
            problems.append(f"{where}: only agent and function steps can be retried.")
        elif not isinstance(retry, dict) or not retry or set(retry) - RETRY_KEYS:
            problems.append(
                f'{where}: retry is an object with max_attempts and optionally initial_delay and max_delay, e.g. {{"max_attempts": 3, "initial_delay": 2}}.'
            )
        else:
            for key, maximum, integer in (
                ("max_attempts", MAX_RETRY_ATTEMPTS, True),
                ("initial_delay", MAX_RETRY_DELAY_SECONDS, False),
                ("max_delay", MAX_RETRY_DELAY_SECONDS, False),
            ):
                if key in retry:
                    problem = _check_number(f"{where} retry", key, retry[key], minimum=1 if integer else 0, maximum=maximum, integer=integer)
                    if problem:
                        problems.append(problem)
            if "max_attempts" not in retry:
                problems.append(f"{where}: retry needs max_attempts (the first try included).")
    if "timeout" in spec:
        problem = _check_number(where, "timeout", spec["timeout"], minimum=1, maximum=MAX_TIMEOUT_SECONDS)
        if problem:
            problems.append(problem)
    return problems


def _edges_from_chains(chains: Any, steps: dict) -> tuple[list[tuple[str, str]], list[str]]:
    """ADK's chain semantics: consecutive elements connect every step to every step."""
    if not isinstance(chains, list) or not chains:
        return [], ['The workflow has no chains: nothing leads from START to a step. Add e.g. ["START", "first_step"].']
    problems: list[str] = []
    edges: list[tuple[str, str]] = []
    for number, chain in enumerate(chains, start=1):
        where = f"Chain {number}"
        if not isinstance(chain, list) or len(chain) < 2:
            problems.append(f"{where} must be a list of at least two elements, e.g. [\"START\", \"triage\"].")
            continue
        groups: list[list[str]] = []
        for position, element in enumerate(chain):
            group = element if isinstance(element, list) else [element]
            if not group:
                problems.append(f"{where} has an empty fan-out (an empty list).")
                groups = []
                break
            bad = False
            for name in group:
                if not isinstance(name, str):
                    problems.append(f"{where}: elements are step names or lists of step names, not {name!r}.")
                    bad = True
                elif name == START_NAME:
                    if position != 0 or isinstance(element, list):
                        problems.append(f"{where}: START can only begin a chain.")
                        bad = True
                elif name not in steps:
                    problems.append(f"{where} names the step {_quote(name)}, which is not defined in steps.")
                    bad = True
            if bad:
                groups = []
                break
            if len(set(group)) != len(group):
                problems.append(f"{where} fans out to the same step twice.")
                groups = []
                break
            if len(group) > 1 and groups and len(groups[-1]) > 1:
                problems.append(
                    f"{where} fans out twice in a row ({', '.join(groups[-1])} then {', '.join(group)}): "
                    "put a join between them."
                )
                groups = []
                break
            groups.append(group)
        for before, after in zip(groups, groups[1:]):
            edges.extend((a, b) for a in before for b in after)
    seen: set[tuple[str, str]] = set()
    for edge in edges:
        if edge in seen:
            problems.append(f"The edge {edge[0]} → {edge[1]} appears more than once.")
        seen.add(edge)
    return list(dict.fromkeys(edges)), problems


def _find_cycle(nodes: list[str], successors: dict[str, list[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in successors.get(node, []):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in nodes:
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def validate_graph(graph: Any, *, workflow_exists: Callable[[str], bool] = lambda name: False) -> dict:
    """Check a graph; return it, or raise WorkflowGraphError listing every problem found."""
    if not isinstance(graph, dict):
        raise WorkflowGraphError(['The graph must be a JSON object with "steps" and "chains".'])
    unknown = sorted(set(graph) - {"steps", "chains"})
    if unknown:
        raise WorkflowGraphError([f"The graph has unknown key(s) {', '.join(unknown)}; it has \"steps\" and \"chains\"."])
    steps = graph.get("steps")
    if not isinstance(steps, dict):
        raise WorkflowGraphError(['"steps" must be an object: {"step_name": {"agent": "support"}, ...}.'])
    if not steps:
        raise WorkflowGraphError(["The workflow is empty: it has no steps."])
    if len(steps) > MAX_STEPS:
        raise WorkflowGraphError([f"The workflow has {len(steps)} steps; at most {MAX_STEPS} are allowed."])
    problems: list[str] = []
    for name, spec in steps.items():
        problem = _check_step_name(name)
        if problem:
            problems.append(problem)
            continue
        problems.extend(_check_step(name, spec, workflow_exists))
    edges, chain_problems = _edges_from_chains(graph.get("chains"), steps)
    problems.extend(chain_problems)
    if problems:
        raise WorkflowGraphError(problems)

    successors: dict[str, list[str]] = {}
    predecessors: dict[str, list[str]] = {name: [] for name in steps}
    for before, after in edges:
        successors.setdefault(before, []).append(after)
        if after == START_NAME:
            continue
        predecessors[after].append(before)

    cycle = _find_cycle([START_NAME, *steps], successors)
    if cycle:
        raise WorkflowGraphError([f"The graph has a cycle: {' → '.join(cycle)}. A workflow must not loop back."])

    reachable: set[str] = set()
    stack = [START_NAME]
    while stack:
        node = stack.pop()
        if node in reachable:
            continue
        reachable.add(node)
        stack.extend(successors.get(node, []))
    if len(reachable) == 1:
        problems.append('No chain begins at START, so nothing would ever run. Begin a chain with "START".')
    for name in steps:
        if name in reachable:
            continue
        if not predecessors[name] and name not in successors:
            problems.append(f"Step {_quote(name)} is defined but no chain uses it.")
        else:
            problems.append(f"Step {_quote(name)} cannot be reached from START.")

    for name, spec in steps.items():
        if name not in reachable or not isinstance(spec, dict):
            continue
        before = sorted(predecessors[name])
        if spec.get("join") is True:
            if len(before) < 2:
                problems.append(
                    f"The join {_quote(name)} is dangling: it follows only {_names(before)}, and a join "
                    "gathers two or more branches. Remove it or fan out before it."
                )
            if name not in successors:
                problems.append(
                    f"The join {_quote(name)} is dangling: nothing comes after it, so what it gathers is "
                    "never used. Add the step that receives it."
                )
        elif len(before) > 1:
            problems.append(
                f"Step {_quote(name)} follows {len(before)} steps ({', '.join(before)}) but is not a join: it "
                "would run once for each. Put a join before it."
            )
    ends = sorted(name for name in steps if name in reachable and name not in successors)
    if len(ends) > 1:
        problems.append(
            f"The workflow ends in {len(ends)} steps ({', '.join(ends)}); it must end in one. Join them first."
        )
    if problems:
        raise WorkflowGraphError(problems)
    return graph


def step_kind(spec: dict) -> tuple[str, str]:
    """(kind, target) of a validated step, e.g. ("agent", "support") or ("join", "")."""
    for kind in STEP_KINDS:
        if kind in spec:
            return kind, "" if kind == "join" else spec[kind]
    raise KeyError("step without a kind")


def referenced_workflows(graph: dict) -> list[str]:
    return [spec["workflow"] for spec in (graph.get("steps") or {}).values() if isinstance(spec, dict) and isinstance(spec.get("workflow"), str)]


def terminal_step(graph: dict) -> str:
    has_successor = {
        name
        for chain in graph["chains"]
        for element in chain[:-1]
        for name in ([element] if isinstance(element, str) else element)
    }
    ends = [name for name in graph["steps"] if name not in has_successor]
    return ends[0]


# --- Snapshots: what a run stores, so it (and its replay) runs the same graph ----------------------


class WorkflowLookup(Protocol):
    def __call__(self, name: str) -> dict | None: ...


def snapshot(name: str, graph: dict, *, lookup: WorkflowLookup) -> dict:
    """The workflow with every sub-workflow it runs, resolved now: {"name", "graph", "workflows"}.

    Raises WorkflowGraphError if a sub-workflow is missing or the workflows include each other.
    """
    resolved: dict[str, dict] = {}

    def resolve(current: str, current_graph: dict, trail: list[str]) -> None:
        for child in referenced_workflows(current_graph):
            if child in trail or child == current:
                loop = " → ".join([*trail, current, child])
                raise WorkflowGraphError([f"Workflows include each other: {loop}. A workflow cannot run itself."])
            if child in resolved:
                continue
            child_graph = lookup(child)
            if child_graph is None:
                raise WorkflowGraphError([f"Workflow {_quote(current)} runs the workflow {_quote(child)}, which does not exist."])
            if len(trail) + 1 >= MAX_NESTING:
                raise WorkflowGraphError([f"Workflows nest more than {MAX_NESTING} deep ({' → '.join([*trail, current, child])})."])
            resolved[child] = child_graph
            resolve(child, child_graph, [*trail, current])

    resolve(name, graph, [])
    return {"name": name, "graph": graph, "workflows": resolved}


def agents_in(snap: dict) -> set[str]:
    graphs = [snap["graph"], *snap.get("workflows", {}).values()]
    return {spec["agent"] for graph in graphs for spec in graph["steps"].values() if "agent" in spec}


def model_agents_in(snap: dict) -> dict[str, Any]:
    """Every LlmAgent the workflow's agent steps run (their trees included), by agent name."""
    found: dict[str, Any] = {}
    for agent_name in sorted(agents_in(snap)):
        try:
            found.update(get_agent_spec(agent_name).llm_agents)
        except UnknownAgentError:
            continue  # validate_graph reports it
    return found


def validate_workflow_params(snap: dict, params: dict, *, faults_enabled: bool) -> None:
    """`params.scripts` gives a script per agent name; `params.script` is for single agents."""
    if "script" in params:
        raise ScriptError(
            "a workflow runs several agents: give params.scripts, a script per agent name "
            '(e.g. {"scripts": {"support": [...]}}), instead of params.script.'
        )
    if "scripts" not in params or not uses_scripted_model():
        return
    scripts = params["scripts"]
    if not isinstance(scripts, dict):
        raise ScriptError("params.scripts must be an object: {agent name: script}.")
    used = model_agents_in(snap)
    for agent_name, script in scripts.items():
        if agent_name not in used:
            raise ScriptError(
                f"params.scripts names the agent {_quote(agent_name)}, which this workflow does not run "
                f"(it runs {_names(used)})."
            )
        try:
            validate_agent_script(used[agent_name], script, faults_enabled=faults_enabled)
        except ScriptError as exc:
            raise ScriptError(f"params.scripts.{agent_name}: {exc}") from None
    refuse_repeated_call_ids({f"params.scripts.{name}": script for name, script in scripts.items()})


# --- Compiling to ADK ----------------------------------------------------------------------------


class StepRecorder(Protocol):
    """Where a step reports itself (the run's RunStep rows)."""

    async def started(self, *, node_path: str, step_name: str, kind: str, target: str) -> None: ...

    async def finished(self, *, node_path: str, output: Any, terminal: bool) -> None: ...

    async def failed(self, *, node_path: str, error: BaseException) -> None: ...

    async def cancelled(self, *, node_path: str) -> None: ...


class StepFailedBeforeAnyTool(Exception):
    """A step failed before any of its tools was called, so trying it again repeats nothing.

    Only this error is retried by a step's retry policy; the original is its `original`.
    """

    def __init__(self, original: BaseException):
        super().__init__(str(original))
        self.original = original


class StepEndedWithError(RuntimeError):
    """An agent step whose last event was an error without an exception (e.g. an empty answer)."""

    def __init__(self, code: str, message: str):
        super().__init__(message or code)
        self.code = code
        self.message = message


def original_error(exc: BaseException) -> BaseException:
    return exc.original if isinstance(exc, StepFailedBeforeAnyTool) else exc


class RecordedStep(BaseNode):
    """One step of a workflow: runs its node and reports step_start, step_complete or step_error.

    It runs the inner node under its own context, so ADK sees a single node with the step's name
    (events carry the step's node path, e.g. `triage_flow@1/billing@1`). A failure is offered to
    the retry policy only when no function call passed in that attempt: an attempt that called a
    tool is never repeated by itself.
    """

    inner: BaseNode
    step_kind: str
    target: str = ""
    terminal: bool = False
    recorder: Any = None

    @property
    def _requires_all_predecessors(self) -> bool:
        return self.inner._requires_all_predecessors

    async def _run_impl(self, *, ctx: Any, node_input: Any):
        path = ctx.node_path
        await self.recorder.started(node_path=path, step_name=self.name, kind=self.step_kind, target=self.target)
        output = None
        called_tools = False
        try:
            ended_with: tuple[str, str] | None = None
            async for event in self.inner.run(ctx=ctx, node_input=node_input):
                if event.get_function_calls():
                    called_tools = True
                if event.output is not None:
                    output = event.output
                if not event.partial:
                    ended_with = (event.error_code, event.error_message or "") if event.error_code else None
                yield event
            if ended_with is not None and ended_with[0] != "INVOCATION_ABORTED":
                # The agent gave up without raising (e.g. the model's empty answer): the step
                # failed, and the steps after it must not run on nothing.
                raise StepEndedWithError(*ended_with)
        except asyncio.CancelledError:
            try:
                await asyncio.shield(self.recorder.cancelled(node_path=path))
            except asyncio.CancelledError:
                pass
            raise
        except Exception as exc:
            await self.recorder.failed(node_path=path, error=exc)
            if self.retry_config is not None and not called_tools and not isinstance(exc, StepFailedBeforeAnyTool):
                raise StepFailedBeforeAnyTool(exc) from exc
            raise
        failure = getattr(ctx, "error", None)
        if failure is not None:
            # A sub-workflow reports a failed step on its context instead of raising.
            await self.recorder.failed(node_path=path, error=failure)
            return
        if output is None:
            # A sub-workflow hands on its last step's output through its context, not an event.
            output = getattr(ctx, "output", None)
        await self.recorder.finished(node_path=path, output=output, terminal=self.terminal)


def _retry_config(spec: dict) -> RetryConfig | None:
    retry = spec.get("retry")
    if not retry:
        return None
    return RetryConfig(
        max_attempts=retry["max_attempts"],
        initial_delay=retry.get("initial_delay", 1.0),
        max_delay=retry.get("max_delay", 60.0),
        exceptions=[StepFailedBeforeAnyTool.__name__],
    )


def _agent_params(params: dict) -> dict:
    # Scripts are addressed by agent name across the whole workflow, sub-agents included.
    return {"scripts": params["scripts"]} if params.get("scripts") else {}


def compile_workflow(snap: dict, *, params: dict, recorder: StepRecorder, name: str | None = None) -> Workflow:
    """An ADK Workflow for a snapshot: chains as tuples, fan-outs as nested tuples, JoinNodes."""
    graph = snap["graph"]
    ending = terminal_step(graph)
    nodes: dict[str, BaseNode] = {}
    for step_name, spec in graph["steps"].items():
        kind, target = step_kind(spec)
        if kind == "agent":
            inner = build_node(build_agent(get_agent_spec(target), params=_agent_params(params)))
        elif kind == "function":
            inner = FunctionNode(func=FUNCTION_STEPS[target].func, name=step_name)
        elif kind == "join":
            inner = JoinNode(name=step_name)
        else:
            child = {"name": target, "graph": snap["workflows"][target], "workflows": snap["workflows"]}
            inner = compile_workflow(child, params=params, recorder=recorder, name=step_name)
        nodes[step_name] = RecordedStep(
            name=step_name,
            inner=inner,
            step_kind=kind,
            target=target,
            terminal=step_name == ending and name is None,
            recorder=recorder,
            wait_for_output=inner.wait_for_output,
            rerun_on_resume=inner.rerun_on_resume,
            retry_config=_retry_config(spec),
            timeout=spec.get("timeout"),
        )
    edges = []
    for chain in graph["chains"]:
        elements = []
        for element in chain:
            if element == START_NAME:
                elements.append(START)
            elif isinstance(element, list):
                elements.append(tuple(nodes[step] for step in element) if len(element) > 1 else nodes[element[0]])
            else:
                elements.append(nodes[element])
        edges.append(tuple(elements))
    return Workflow(name=name or snap["name"], edges=edges)
