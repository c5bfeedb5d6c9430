"""The offline `scripted` model: a real ADK BaseLlm that plays a script, one step per call.

Steps (docs/agents.md, "The demo agent and the offline scripted model", has the whole format):
  {"call": "send_email", "args": {...}}        answer with that function call
  [{"call": ...}, {"call": ...}]               parallel calls in one turn
  {"say": "text"}                              final text
  {"say": "text", "if_rejected": "other"}      "other" instead when the call just answered was rejected
                                               by a person (or the approval timeout): the model takes
                                               the answer into account
  {"fail": "rate_limit"}                       the 429 Gemini raises (ClientError, code 429)
  {"fail": "error", "message": "..."}          an error with that message
  {"fail": ..., "once": true}                  a transient failure: only the first run of its chain
                                               fails there; its replays and resumes play on
  {"empty": true}                              an empty turn
  {"call": "transfer_to_agent", "args": {"agent_name": "billing"}}   hand over to another agent

Any step may carry "latency": seconds, the provider's time: the model sleeps that long (without
blocking the loop) before it answers; for benchmarks of many runs in flight.

A call step may carry a fault for its tool: "tool_fails": "message", "crash": "before_effect" |
"after_effect", "hang": seconds. Faults are handed to the tool through `agents.faults`, keyed
by the function call id, so the failure happens for real inside the tool.

Each answer carries the script position it played (`custom_metadata["scripted_step"]`: the step's
index and, for a call step, which of its calls each function call is), stored with its event. A
resumed run (docs/architecture.md, "Resume rules") continues the script from there
(`ScriptPosition`, derived by `resume_position` from the model turns recorded for the run and
the runs it resumes), and first plays again the calls its resume answered as not done, the way
a real model retries what did not happen: played again without their faults (a fault stood for
what befell that attempt) and under fresh call ids (the session already holds the old ones).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.genai import errors as genai_errors
from google.genai import types
from pydantic import PrivateAttr

from agents import faults

SCRIPT_EXHAUSTED_TEXT = "I have nothing more to add."
FAULT_KEYS = {"tool_fails", "crash", "hang"}
LATENCY = "latency"
MAX_LATENCY_SECONDS = 600
CALL_KEYS = {"call", "args", "id", LATENCY} | FAULT_KEYS
CRASH_POINTS = {"before_effect", "after_effect"}
# ADK's tool for handing the conversation to another agent; a call step to it is a transfer.
TRANSFER_TOOL = "transfer_to_agent"
MAX_SCRIPT_STEPS = 500
# The journal's column for a call id (runs.models.ledger.ToolCall.call_id).
MAX_CALL_ID_CHARS = 128
# Where each answer sits in its script, stored in its event's custom_metadata.
SCRIPT_STEP_KEY = "scripted_step"
# ADK's answer to a call a person rejected (google.adk.tools._confirmation_utils).
REJECTED_ANSWER = {"error": "This tool call is rejected."}
# What a transient (`"once": true`) failure step becomes in a replay or resume: a step played as
# nothing (the model goes on to the next one). Internal: a script cannot contain it.
SPENT_STEP = {"spent": True}


class ScriptError(ValueError):
    """A script that cannot be played; the message names the step and the problem."""


class ScriptedModelError(RuntimeError):
    """The error a `{"fail": "error"}` step raises."""


def rate_limit_error(retry_delay_seconds: float | None = None) -> genai_errors.ClientError:
    """The same exception google-genai raises for an HTTP 429 from Gemini."""
    error: dict[str, Any] = {
        "code": 429,
        "message": "Resource has been exhausted (e.g. check quota).",
        "status": "RESOURCE_EXHAUSTED",
    }
    if retry_delay_seconds is not None:
        error["details"] = [
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": f"{retry_delay_seconds}s"}
        ]
    return genai_errors.ClientError(429, {"error": error})


def _validate_latency(step: dict, where: str) -> None:
    if LATENCY not in step:
        return
    latency = step[LATENCY]
    if isinstance(latency, bool) or not isinstance(latency, int | float) or not 0 <= latency <= MAX_LATENCY_SECONDS:
        raise ScriptError(f"{where}: \"latency\" must be a number of seconds from 0 to {MAX_LATENCY_SECONDS}.")


def _without_latency(step: dict) -> dict:
    return {key: value for key, value in step.items() if key != LATENCY}


def step_latency(step: Any) -> float:
    """How long the model takes to answer `step` (a parallel turn: its slowest call)."""
    calls = step if isinstance(step, list) else [step]
    return max((float(call.get(LATENCY, 0)) for call in calls if isinstance(call, dict)), default=0.0)


def _validate_call(
    step: Any,
    where: str,
    tool_names: Iterable[str] | None,
    faults_enabled: bool,
    transfer_targets: Iterable[str] | None = None,
) -> None:
    if not isinstance(step, dict):
        raise ScriptError(f"{where}: a parallel call list may only hold call steps.")
    unknown = set(step) - CALL_KEYS
    if unknown:
        raise ScriptError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} in a call step.")
    name = step.get("call")
    if not isinstance(name, str) or not name:
        raise ScriptError(f"{where}: \"call\" must be a tool name.")
    if tool_names is not None and name not in set(tool_names):
        raise ScriptError(
            f"{where}: the agent has no tool named {name!r} (it has {', '.join(sorted(tool_names))})."
        )
    if not isinstance(step.get("args", {}), dict):
        raise ScriptError(f"{where}: \"args\" must be an object.")
    if name == TRANSFER_TOOL and transfer_targets is not None:
        target = (step.get("args") or {}).get("agent_name")
        if target not in set(transfer_targets):
            raise ScriptError(
                f"{where}: transfer_to_agent needs args.agent_name, one of {', '.join(sorted(transfer_targets)) or 'none'} "
                f"(got {target!r})."
            )
    _validate_latency(step, where)
    if "id" in step and (not isinstance(step["id"], str) or not step["id"]):
        raise ScriptError(f"{where}: \"id\" must be a non-empty string.")
    if "id" in step and len(step["id"]) > MAX_CALL_ID_CHARS:
        raise ScriptError(f"{where}: \"id\" is longer than {MAX_CALL_ID_CHARS} characters.")
    present_faults = FAULT_KEYS & set(step)
    if present_faults and not faults_enabled:
        raise ScriptError(
            f"{where}: tool faults ({', '.join(sorted(present_faults))}) are disabled here; "
            "set SCRIPTED_FAULTS_ENABLED=true to use them."
        )
    if "tool_fails" in step and not isinstance(step["tool_fails"], str):
        raise ScriptError(f"{where}: \"tool_fails\" must be the error message, a string.")
    if "crash" in step and step["crash"] not in CRASH_POINTS:
        raise ScriptError(f"{where}: \"crash\" must be \"before_effect\" or \"after_effect\".")
    if "hang" in step:
        hang = step["hang"]
        if isinstance(hang, bool) or not isinstance(hang, int | float) or hang <= 0:
            raise ScriptError(f"{where}: \"hang\" must be a positive number of seconds.")


def validate_script(
    script: Any,
    *,
    tool_names: Iterable[str] | None = None,
    faults_enabled: bool = True,
    transfer_targets: Iterable[str] | None = None,
) -> list:
    """Check a script and return it; raise ScriptError naming the first bad step."""
    if not isinstance(script, list):
        raise ScriptError("The script must be a list of steps.")
    if not script:
        raise ScriptError("The script is empty: give at least one step.")
    if len(script) > MAX_SCRIPT_STEPS:
        raise ScriptError(f"The script has {len(script)} steps; at most {MAX_SCRIPT_STEPS} are allowed.")
    for index, step in enumerate(script, start=1):
        where = f"Step {index}"
        if isinstance(step, list):
            if not step:
                raise ScriptError(f"{where}: a parallel call list cannot be empty.")
            for call in step:
                _validate_call(call, where, tool_names, faults_enabled, transfer_targets)
            continue
        if not isinstance(step, dict):
            raise ScriptError(f"{where}: a step must be an object or a list of call objects.")
        if "call" not in step:
            _validate_latency(step, where)
            step = _without_latency(step)
        if "call" in step:
            _validate_call(step, where, tool_names, faults_enabled, transfer_targets)
        elif "say" in step:
            if set(step) - {"say", "if_rejected"} or not all(isinstance(step[key], str) for key in step):
                raise ScriptError(
                    f"{where}: a say step is {{\"say\": \"text\"}}, optionally with \"if_rejected\": \"text\"."
                )
        elif "fail" in step:
            if "once" in step and step["once"] is not True:
                raise ScriptError(f"{where}: \"once\" is true or absent.")
            if step["fail"] == "rate_limit":
                if set(step) - {"fail", "retry_delay", "once"}:
                    raise ScriptError(f"{where}: a rate-limit step is {{\"fail\": \"rate_limit\"}}.")
            elif step["fail"] == "error":
                if set(step) - {"fail", "message", "once"} or not isinstance(step.get("message", ""), str):
                    raise ScriptError(
                        f"{where}: an error step is {{\"fail\": \"error\", \"message\": \"...\"}}."
                    )
            else:
                raise ScriptError(f"{where}: \"fail\" must be \"rate_limit\" or \"error\".")
        elif "empty" in step:
            if step != {"empty": True}:
                raise ScriptError(f"{where}: an empty-turn step is {{\"empty\": true}}.")
        else:
            raise ScriptError(f"{where}: expected one of call, say, fail or empty.")
    refuse_repeated_call_ids({"": script})
    return script


def explicit_call_ids(script: list) -> list[tuple[str, int]]:
    """The call ids a script gives explicitly, with the step (from 1) that gives each."""
    found = []
    for index, step in enumerate(script, start=1):
        for call in step if isinstance(step, list) else [step]:
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                found.append((call["id"], index))
    return found


def refuse_repeated_call_ids(scripts: dict[str, list]) -> None:
    """Raise ScriptError naming the steps if an explicit call id repeats within one run's scripts.

    The journal keeps one row per (run, call id): a second call with the same id could only be
    refused when it is made, after the run had started. `scripts` maps a label ("" for a lone
    script, else e.g. "params.scripts.billing") to its steps.
    """
    seen: dict[str, list[str]] = {}
    for label, script in scripts.items():
        if not isinstance(script, list):
            continue
        for call_id, index in explicit_call_ids(script):
            seen.setdefault(call_id, []).append(f"{label}: step {index}" if label else f"step {index}")
    repeated = {call_id: where for call_id, where in seen.items() if len(where) > 1}
    if repeated:
        raise ScriptError(
            "Each call id must be unique in a run: "
            + "; ".join(f"{', '.join(where)} use the id {call_id!r}" for call_id, where in repeated.items())
            + "."
        )


def _usage(llm_request: LlmRequest) -> types.GenerateContentResponseUsageMetadata:
    # Rough token counts (four characters a token) so usage telemetry has something honest.
    prompt_chars = sum(len(part.text or "") for content in llm_request.contents for part in content.parts or [])
    return types.GenerateContentResponseUsageMetadata(prompt_token_count=prompt_chars // 4, candidates_token_count=0)


@dataclass(frozen=True)
class ScriptPosition:
    """Where a resumed run's model starts: the next step, after the calls to play again.

    `again` holds (step index, positions of its calls) for each recorded turn with a call the
    resume answered as not done; `id_suffix` keeps the calls played again apart from the old ones.
    """

    start: int = 0
    again: tuple[tuple[int, tuple[int, ...]], ...] = ()
    id_suffix: str = ""


def resume_position(turns: Iterable[dict], *, not_done: Collection[str], id_suffix: str) -> ScriptPosition:
    """The position after `turns` (an agent's recorded answers, oldest first: each `{"step", "calls",
    "call_ids"}`), playing again the calls whose ids are in `not_done`."""
    start = 0
    again: list[tuple[int, tuple[int, ...]]] = []
    for turn in turns:
        step = turn.get("step")
        if not isinstance(step, int) or step < 0:
            continue
        start = max(start, step + 1)
        positions = tuple(
            position
            for position, call_id in zip(turn.get("calls") or [], turn.get("call_ids") or [], strict=False)
            if call_id in not_done and isinstance(position, int)
        )
        if positions:
            again.append((step, positions))
    return ScriptPosition(start=start, again=tuple(again), id_suffix=id_suffix)


def transient_failures_spent(params: dict) -> dict:
    """`params` for a replay or resume: each `"once": true` failure of its scripts is spent (played as
    nothing), the step indices unchanged so a resume's recorded positions still point right."""

    def spent(script: Any) -> Any:
        if not isinstance(script, list):
            return script
        return [SPENT_STEP if isinstance(step, dict) and "fail" in step and step.get("once") is True else step
                for step in script]

    if not isinstance(params, dict):
        return params
    changed = dict(params)
    if "script" in changed:
        changed["script"] = spent(changed["script"])
    if isinstance(changed.get("scripts"), dict):
        changed["scripts"] = {name: spent(script) for name, script in changed["scripts"].items()}
    return changed


def answered_rejected(llm_request: LlmRequest) -> bool:
    """Whether the newest function answers the model receives include a person's rejection."""
    for content in reversed(llm_request.contents or []):
        answers = [part.function_response for part in content.parts or [] if part.function_response]
        if answers:
            return any(answer.response == REJECTED_ANSWER for answer in answers)
    return False


def _without_faults(call: dict) -> dict:
    return {key: value for key, value in call.items() if key not in FAULT_KEYS}


# Observers see every request the scripted model receives: tests and benchmarks use them to
# assert on what the model was actually sent (memory, stripped payloads).
request_observers: list[Callable[[LlmRequest], None]] = []


class ScriptedLlm(BaseLlm):
    model: str = "scripted"
    script: list = []
    position: ScriptPosition = ScriptPosition()
    _cursor: int = PrivateAttr(default=0)
    _calls: int = PrivateAttr(default=0)
    _again: list = PrivateAttr(default_factory=list)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        self._cursor = self.position.start
        self._again = list(self.position.again)

    @classmethod
    def supported_models(cls) -> list[str]:
        return [r"scripted"]

    @property
    def calls_made(self) -> int:
        """Model calls this model object answered (a resumed run's count starts at 0)."""
        return self._calls

    def _next_step(self) -> tuple[Any, dict, str]:
        """(step, its position for the event's metadata, call-id suffix)."""
        self._calls += 1
        if self._again:
            index, positions = self._again.pop(0)
            step = self.script[index]
            calls = step if isinstance(step, list) else [step]
            picked = [_without_faults(calls[position]) for position in positions if position < len(calls)]
            if picked:
                return picked, {"step": index, "calls": list(positions)}, self.position.id_suffix
        index = self._cursor
        self._cursor += 1
        while index < len(self.script) and self.script[index] == SPENT_STEP:
            index = self._cursor
            self._cursor += 1
        if index >= len(self.script):
            return {"say": SCRIPT_EXHAUSTED_TEXT}, {"step": index}, ""
        step = self.script[index]
        where: dict = {"step": index}
        if isinstance(step, list):
            where["calls"] = list(range(len(step)))
        elif "call" in step:
            where["calls"] = [0]
        return step, where, ""

    @staticmethod
    def _call_part(step: dict, id_suffix: str = "") -> types.Part:
        # A full uuid4: the journal keeps one row per (run, call id), so ids must never collide.
        call_id = f"{step['id']}{id_suffix}" if step.get("id") else f"call-{uuid.uuid4().hex}"
        fault = {key: step[key] for key in FAULT_KEYS if key in step}
        if fault:
            faults.arm(call_id, fault)
        return types.Part(
            function_call=types.FunctionCall(id=call_id, name=step["call"], args=dict(step.get("args") or {}))
        )

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        for observer in list(request_observers):
            observer(llm_request)
        step, where, id_suffix = self._next_step()
        metadata = {SCRIPT_STEP_KEY: where}
        latency = step_latency(step)
        if latency:
            await asyncio.sleep(latency)
        if isinstance(step, list):
            parts = [self._call_part(call, id_suffix) for call in step]
        elif "call" in step:
            parts = [self._call_part(step, id_suffix)]
        elif "say" in step:
            text = step["if_rejected"] if "if_rejected" in step and answered_rejected(llm_request) else step["say"]
            parts = [types.Part(text=text)]
        elif step.get("fail") == "rate_limit":
            raise rate_limit_error(step.get("retry_delay"))
        elif step.get("fail") == "error":
            raise ScriptedModelError(step.get("message") or "The scripted model failed.")
        elif step.get("empty"):
            yield LlmResponse(
                content=types.Content(role="model", parts=[]),
                finish_reason=types.FinishReason.STOP,
                usage_metadata=_usage(llm_request),
                custom_metadata=metadata,
            )
            return
        else:  # validate_script makes this unreachable for stored scripts
            raise ScriptError(f"Unplayable step: {step!r}")
        yield LlmResponse(
            content=types.Content(role="model", parts=parts),
            finish_reason=types.FinishReason.STOP,
            usage_metadata=_usage(llm_request),
            custom_metadata=metadata,
        )
