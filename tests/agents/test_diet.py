"""The memory diet: old turns reach the model without their large base64 payloads."""

from __future__ import annotations

import base64
import io
import os
import uuid

import pytest
from google.adk.agents import LlmAgent
from google.adk.models.llm_request import LlmRequest
from google.genai import types

from agents import diet, registry
from agents.models import AdkEvent
from tests.helpers import SAY_DONE, run_now, script_params

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
pytestmark = pytest.mark.django_db(transaction=True)

IMAGE_BYTES = 120_000
PROSE = ("The customer explained at length why the refund matters to her, sentence after sentence. " * 200).strip()


def _image(turn: int) -> bytes:
    # PNG magic, then noise: incompressible, like a real photo.
    return b"\x89PNG\r\n\x1a\n" + bytes([turn]) + os.urandom(IMAGE_BYTES - 9)


def _inline_parts(request: LlmRequest) -> list[types.Part]:
    return [p for c in request.contents for p in c.parts or [] if p.inline_data is not None]


def _texts(request: LlmRequest) -> list[str]:
    return [p.text for c in request.contents for p in c.parts or [] if p.text]


def test_after_five_image_turns_the_model_gets_the_image_bytes_once(requests_seen):
    session_id = str(uuid.uuid4())
    images = [_image(turn) for turn in range(1, 6)]
    for turn, image in enumerate(images, start=1):
        run_now(
            message=f"Turn {turn}: what is on this picture? {PROSE if turn == 1 else ''}",
            file=io.BytesIO(image),
            file_name=f"photo-{turn}.png",
            session_id=session_id,
            params=script_params(SAY_DONE),
        )

    last = requests_seen[-1]
    inline = _inline_parts(last)
    assert len(inline) == 1
    assert inline[0].inline_data.data == images[-1]  # the latest turn, whole
    markers = [t for t in _texts(last) if t.startswith("<stripped:")]
    assert markers == [f"<stripped: {len(base64.b64encode(image))} chars>" for image in images[:4]]
    # Long ordinary text in an old turn is sent as it was.
    assert any(PROSE in text for text in _texts(last))

    # The stored session still carries all five images, byte for byte.
    user_events = [
        e for e in AdkEvent.objects.filter(session_id=session_id).order_by("timestamp") if e.author == "user"
    ]
    stored = [p["inline_data"]["data"] for e in user_events for p in e.parts if p.get("inline_data")]
    assert [base64.urlsafe_b64decode(data) if "-" in data or "_" in data else base64.b64decode(data)
            for data in stored] == images


def test_the_running_session_is_never_modified(monkeypatch):
    """The callback gets copies: the runner's own session events keep their payloads."""
    observed: list[list[int]] = []

    def after_the_diet(callback_context, llm_request):
        session = callback_context._invocation_context.session
        observed.append([
            len(p.inline_data.data) for e in session.events for p in (e.content.parts if e.content else []) or []
            if p.inline_data is not None
        ])
        return None

    spec = registry.describe(
        "observer",
        LlmAgent(name="observer", description="test", instruction="test", before_model_callback=after_the_diet),
        default_script=[SAY_DONE],
    )
    monkeypatch.setitem(registry.AGENTS, "observer", spec)
    session_id = str(uuid.uuid4())
    for turn in range(1, 4):
        run_now(agent_name="observer", message=f"turn {turn}", file=io.BytesIO(_image(turn)),
                file_name="p.png", session_id=session_id)

    assert observed[-1] == [IMAGE_BYTES] * 3


def fetch_chart() -> dict:
    """Render the customer's usage chart."""
    return {
        "chart_png": base64.b64encode(_image(9)).decode(),
        "explanation": PROSE,
        "chart_id": "chart-42",
    }


@pytest.fixture
def chart_agent(monkeypatch):
    spec = registry.describe(
        "charts",
        LlmAgent(name="charts", description="test", instruction="test", tools=[fetch_chart]),
        default_script=[{"call": "fetch_chart", "args": {}}, SAY_DONE],
    )
    monkeypatch.setitem(registry.AGENTS, "charts", spec)
    return spec


def _function_responses(request: LlmRequest) -> list[dict]:
    return [p.function_response.response for c in request.contents for p in c.parts or [] if p.function_response]


def test_base64_in_an_old_function_response_is_stripped_and_prose_is_kept(chart_agent, requests_seen):
    session_id = str(uuid.uuid4())
    run_now(agent_name="charts", message="show me the chart", session_id=session_id)
    # Within its own turn, the model sees the tool's whole answer.
    same_turn = _function_responses(requests_seen[-1])
    assert len(same_turn[0]["chart_png"]) > 100_000

    run_now(agent_name="charts", message="thanks", session_id=session_id, params=script_params(SAY_DONE))
    [old] = _function_responses(requests_seen[-1])
    encoded = len(base64.b64encode(_image(9)))
    assert old == {"chart_png": f"<stripped: {encoded} chars>", "explanation": PROSE, "chart_id": "chart-42"}

    stored = [r for e in AdkEvent.objects.filter(session_id=session_id) for r in e.function_responses]
    assert len(stored[0]["response"]["chart_png"]) == encoded


def test_every_agent_gets_the_diet_first(chart_agent):
    for spec in [*registry.AGENTS.values()]:
        agent = registry.build_agent(spec, params={})
        assert agent.canonical_before_model_callbacks[0] is diet.strip_old_payloads


# --- The rules, on contents built by hand ------------------------------------------------------------


def _user(*parts: types.Part) -> types.Content:
    return types.Content(role="user", parts=list(parts))


def _tool_result(response: dict) -> types.Content:
    return types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
        id="c1", name="fetch_chart", response=response))])


def _model(text: str) -> types.Content:
    return types.Content(role="model", parts=[types.Part(text=text)])


B64 = base64.b64encode(os.urandom(6000)).decode()  # 8000 chars


@pytest.mark.parametrize(
    "value, stripped",
    [
        (B64, True),
        (f"data:image/png;base64,{B64}", True),
        ("\n".join(B64[i : i + 76] for i in range(0, len(B64), 76)), True),  # MIME line breaks
        (base64.urlsafe_b64encode(os.urandom(6000)).decode(), True),
        (B64[:3999], False),  # under STRIP_PAYLOAD_MIN_CHARS
        (PROSE, False),
        ("x" * 3000 + " " + "y" * 3000, False),
        ('{"json": "' + "a" * 5000 + '"}', False),
    ],
)
def test_what_looks_like_base64(value, stripped):
    assert diet.looks_like_base64(value, min_chars=4000) is stripped


def test_the_latest_turn_is_never_touched_and_inputs_are_never_mutated():
    old_image = types.Part(inline_data=types.Blob(mime_type="image/png", data=b"\x00" * 9000))
    nested = {"pages": [{"scan": B64, "text": PROSE}], "count": 1}
    contents = [
        _user(types.Part(text="first"), old_image),
        _tool_result(nested),
        _model("ok"),
        _user(types.Part(text="now this"), types.Part(inline_data=types.Blob(mime_type="image/png", data=b"\x01" * 9000))),
        _tool_result({"scan": B64}),
    ]
    snapshot = [c.model_dump() for c in contents]
    latest_turn = contents[3:]

    result, removed = diet.strip_contents(contents, min_chars=4000)

    assert result[0].parts[0].text == "first"
    assert result[0].parts[1].text == "<stripped: 12000 chars>"
    assert result[1].parts[0].function_response.response == {
        "pages": [{"scan": "<stripped: 8000 chars>", "text": PROSE}],
        "count": 1,
    }
    assert result[2] is contents[2]
    # From the latest user message on, everything goes as it is, tool results included.
    assert result[3:] == latest_turn and all(a is b for a, b in zip(result[3:], latest_turn, strict=True))
    assert removed == 12000 + 8000
    # The inputs (shared with the session in ADK) are exactly as they were.
    assert [c.model_dump() for c in contents] == snapshot
    assert nested["pages"][0]["scan"] == B64
    assert contents[0].parts[1] is old_image and old_image.inline_data.data == b"\x00" * 9000


def test_the_callback_leaves_a_request_with_nothing_to_strip_alone(settings):
    settings.STRIP_PAYLOAD_MIN_CHARS = 4000
    contents = [_user(types.Part(text=PROSE)), _model("ok"), _user(types.Part(text="again"))]
    request = LlmRequest(contents=list(contents))
    assert diet.strip_old_payloads(None, request) is None
    assert all(a is b for a, b in zip(request.contents, contents, strict=True))


def test_the_threshold_comes_from_the_settings(settings):
    settings.STRIP_PAYLOAD_MIN_CHARS = 10_000
    request = LlmRequest(contents=[_tool_result({"scan": B64}), _model("ok"), _user(types.Part(text="next"))])
    diet.strip_old_payloads(None, request)
    assert request.contents[0].parts[0].function_response.response == {"scan": B64}
    settings.STRIP_PAYLOAD_MIN_CHARS = 4000
    diet.strip_old_payloads(None, request)
    assert request.contents[0].parts[0].function_response.response == {"scan": "<stripped: 8000 chars>"}


MEMORY_BLOCK = _user(types.Part(text=(
    "The following content is from your previous conversations with the user.\n"
    "<PAST_CONVERSATIONS>\nuser: I asked about my refund last week.\n</PAST_CONVERSATIONS>\n"
)))


def _photo_message(text: str) -> types.Content:
    return _user(types.Part(text=text), types.Part(inline_data=types.Blob(mime_type="image/png", data=_image(1))))


def _call(name: str) -> types.Content:
    return types.Content(role="model", parts=[types.Part(function_call=types.FunctionCall(id="c1", name=name, args={}))])


def test_the_memory_block_after_the_latest_tool_answer_is_not_taken_for_the_turns_start(settings):
    # Where ADK's preload_memory puts its block when the model continues after a tool.
    own = _photo_message("What is on this picture?")
    contents = [own, _call("fetch_chart"), _tool_result({"scan": B64}), MEMORY_BLOCK]

    for message in (own, None):  # as the invocation knows it, and without (a resumed run)
        kept, removed = diet.strip_contents(list(contents), min_chars=4000, own_message=message)
        assert removed == 0
        assert kept[0].parts[1].inline_data.data == own.parts[1].inline_data.data
        assert kept[2].parts[0].function_response.response == {"scan": B64}


def test_an_earlier_runs_file_is_stripped_and_the_current_runs_kept(settings):
    earlier, own = _photo_message("First picture."), _photo_message("Second picture.")
    contents = [earlier, _model("A chart."), own, _call("fetch_chart"), _tool_result({"scan": B64}), MEMORY_BLOCK]

    kept, removed = diet.strip_contents(list(contents), min_chars=4000, own_message=own)
    assert kept[0].parts[1].text.startswith("<stripped:")
    assert removed == len(base64.b64encode(earlier.parts[1].inline_data.data))
    assert kept[2] is own and kept[4] is contents[4]
