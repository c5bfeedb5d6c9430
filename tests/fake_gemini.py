"""A local HTTP server that speaks Gemini's REST API, for driving the real google-genai client.

The app reaches it as it would reach Gemini: `GOOGLE_API_KEY` set, `GOOGLE_GEMINI_BASE_URL`
pointing here, `POST /v1beta/models/{model}:generateContent` (and `:streamGenerateContent?alt=sse`)
with the JSON google-genai sends. Each request is answered by the next entry of `replies`, or by
`responder(request)` once they run out; every request is kept in `requests` as it arrived.

A reply is one of:
- a dict without a `"fault"` key: sent as the 200 JSON body (see `text()`, `call()`, `finish()`);
- `error(code, status, message, retry_delay=…)`: a JSON error body with that HTTP status;
- `{"fault": "drop"}`: the connection is closed without a response;
- `{"fault": "cut"}`: the headers and half of a body are sent, then the connection is closed;
- `{"fault": "not_json"}`: a 200 whose body is an HTML page (a proxy's, say);
- `{"fault": "slow", "seconds": s, "then": reply}`: `reply` after `s` seconds;
- `{"fault": "hang"}`: no answer until the server stops.

Run as a script (`python tests/fake_gemini.py --port 8089 --latency 1`) it serves the `support`
agent's usual conversation for benchmarks and manual tries.
"""

from __future__ import annotations

import argparse
import base64
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class SeenRequest:
    path: str
    headers: dict[str, str]
    body: dict

    @property
    def model(self) -> str:
        return self.path.split("/models/", 1)[1].split(":", 1)[0]

    @property
    def contents(self) -> list[dict]:
        return self.body.get("contents", [])

    @property
    def system_instruction(self) -> str:
        parts = (self.body.get("systemInstruction") or {}).get("parts", [])
        return "\n".join(part.get("text", "") for part in parts)

    @property
    def function_names(self) -> list[str]:
        return [
            declaration["name"]
            for tool in self.body.get("tools", [])
            for declaration in tool.get("functionDeclarations", [])
        ]

    def parts(self) -> list[dict]:
        return [part for content in self.contents for part in content.get("parts", [])]

    def texts(self) -> list[str]:
        return [part["text"] for part in self.parts() if "text" in part]

    def inline_data(self) -> list[dict]:
        return [part["inlineData"] for part in self.parts() if "inlineData" in part]

    def function_responses(self) -> list[dict]:
        return [part["functionResponse"] for part in self.parts() if "functionResponse" in part]


# --- Answers -------------------------------------------------------------------------------------


def _candidate(parts: list[dict] | None, finish_reason: str | None) -> dict:
    candidate: dict[str, Any] = {"index": 0}
    if parts is not None:
        candidate["content"] = {"role": "model", "parts": parts}
    if finish_reason is not None:
        candidate["finishReason"] = finish_reason
    return candidate


def answer(*candidates: dict, **extra: Any) -> dict:
    body = {
        "candidates": list(candidates),
        "usageMetadata": {"promptTokenCount": 12, "candidatesTokenCount": 5, "totalTokenCount": 17},
        "modelVersion": "gemini-2.5-flash",
        "responseId": "fake-response",
    }
    body.update(extra)
    return body


def text(value: str, *, finish_reason: str = "STOP", thought_signature: str | None = None) -> dict:
    part: dict[str, Any] = {"text": value}
    if thought_signature:
        part["thoughtSignature"] = thought_signature
    return answer(_candidate([part], finish_reason))


def call_part(name: str, args: dict, *, call_id: str | None = None, thought_signature: str | None = None) -> dict:
    function_call: dict[str, Any] = {"name": name, "args": args}
    if call_id:
        function_call["id"] = call_id
    part: dict[str, Any] = {"functionCall": function_call}
    if thought_signature:
        part["thoughtSignature"] = thought_signature
    return part


def call(name: str, args: dict, **kwargs: Any) -> dict:
    return answer(_candidate([call_part(name, args, **kwargs)], "STOP"))


def calls(*parts: dict) -> dict:
    """Parallel function calls in one answer (each from `call_part`)."""
    return answer(_candidate(list(parts), "STOP"))


def finish(reason: str | None, *, parts: list[dict] | None = None, message: str | None = None) -> dict:
    """One candidate that ends with `reason` (parts None: no content at all)."""
    candidate = _candidate(parts, reason)
    if message:
        candidate["finishMessage"] = message
    return answer(candidate)


def no_candidates() -> dict:
    return {"usageMetadata": {"promptTokenCount": 12, "totalTokenCount": 12}, "modelVersion": "gemini-2.5-flash"}


def prompt_blocked(reason: str = "SAFETY") -> dict:
    return {"promptFeedback": {"blockReason": reason}, "modelVersion": "gemini-2.5-flash"}


def error(code: int, status: str, message: str, *, retry_delay: str | None = None) -> dict:
    details = []
    if retry_delay is not None:
        details.append({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": retry_delay})
    return {"fault": "error", "code": code, "body": {"error": {"code": code, "message": message, "status": status, "details": details}}}


def rate_limited(retry_delay: str | None = "0s") -> dict:
    return error(429, "RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota).", retry_delay=retry_delay)


def unavailable() -> dict:
    return error(503, "UNAVAILABLE", "The model is overloaded. Please try again later.")


def signature(label: str) -> str:
    """A thought signature as Gemini sends them: opaque base64."""
    return base64.b64encode(f"signature-of-{label}".encode()).decode()


# --- The conversation the `support` agent usually has --------------------------------------------

SUPPORT_STEPS = [
    ("lookup_customer", {"email": "jane@example.com"}),
    ("send_email", {"to": "jane@example.com", "subject": "Your refund", "body": "Your refund has been issued."}),
    ("update_crm", {"contact_id": "C-1001", "note": "Refund confirmed by email."}),
]
SUPPORT_ANSWER = "I looked Jane up, emailed her about her refund and noted it in the CRM."


def support_conversation(request: SeenRequest) -> dict:
    """The next step of `support`'s conversation, read from the request itself.

    Stateless, so any number of runs can be served at once: the step is the number of tool
    answers since the latest user message.
    """
    answered = 0
    for content in reversed(request.contents):
        parts = content.get("parts", [])
        if content.get("role") == "user" and not any("functionResponse" in part for part in parts):
            if not any("<PAST_CONVERSATIONS>" in part.get("text", "") for part in parts):
                break
            continue
        answered += sum(1 for part in parts if "functionResponse" in part)
    if answered < len(SUPPORT_STEPS):
        name, args = SUPPORT_STEPS[answered]
        return call(name, args, thought_signature=signature(name))
    return text(SUPPORT_ANSWER)


# --- The server -----------------------------------------------------------------------------------


@dataclass
class FakeGemini:
    """The server, its replies and what it was sent. Use as a context manager or start()/stop()."""

    replies: list[dict] = field(default_factory=list)
    responder: Callable[[SeenRequest], dict] | None = None
    latency: float = 0.0
    port: int = 0
    requests: list[SeenRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self.in_flight = 0
        self.max_in_flight = 0

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def env(self) -> dict[str, str]:
        """What a process needs to send its model calls here."""
        return {"GOOGLE_API_KEY": "fake-key", "GOOGLE_GEMINI_BASE_URL": self.base_url}

    def add(self, *replies: dict) -> None:
        with self._lock:
            self.replies.extend(replies)

    def _next_reply(self, request: SeenRequest) -> dict:
        with self._lock:
            self.requests.append(request)
            if self.replies:
                return self.replies.pop(0)
        if self.responder is not None:
            return self.responder(request)
        return error(500, "INTERNAL", "The fake server has no reply left for this request.")

    def start(self) -> FakeGemini:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"unreadable": raw.decode(errors="replace")}
                request = SeenRequest(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                with fake._lock:
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    if fake.latency:
                        time.sleep(fake.latency)
                    self._reply(fake._next_reply(request), streaming=":streamGenerateContent" in self.path)
                finally:
                    with fake._lock:
                        fake.in_flight -= 1

            def _send(self, status: int, payload: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _reply(self, reply: dict, *, streaming: bool) -> None:
                fault = reply.get("fault")
                if fault == "slow":
                    if fake._stopped.wait(reply["seconds"]):
                        return
                    return self._reply(reply["then"], streaming=streaming)
                if fault == "hang":
                    fake._stopped.wait()
                    self.close_connection = True
                    return
                if fault == "drop":
                    self.close_connection = True
                    return
                if fault == "cut":
                    payload = json.dumps(text("This answer never arrives whole.")).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if fault == "not_json":
                    return self._send(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")
                if fault == "error":
                    return self._send(reply["code"], json.dumps(reply["body"]).encode(), "application/json")
                if streaming:
                    return self._send(200, f"data: {json.dumps(reply)}\r\n\r\n".encode(), "text/event-stream")
                return self._send(200, json.dumps(reply).encode(), "application/json")

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="fake-gemini", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> FakeGemini:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    options = parser.parse_args()
    fake = FakeGemini(responder=support_conversation, latency=options.latency, port=options.port).start()
    print(f"Serving Gemini's REST API for the support agent on {fake.base_url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        fake.stop()


if __name__ == "__main__":
    main()
