"""ADK's own wires on the ledger: /adk/run_sse against ADK's own api_server, A2A against the REST API.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/adk_wire.py [--turns 20]

1. Time to the first and to the last event of `POST /adk/run_sse` on the ledger's live server
   (`manage.py serve`'s uvicorn: token authentication, the run written before it executes, the
   claim, the heartbeat, the journal, the settle) against ADK's own API server (`get_fast_api_app`,
   uvicorn) serving the same `support` agent on the same database (its `DatabaseSessionService` on
   the same tables), both answering the same turn: a `lookup_customer` call, then a sentence. Each
   turn gets a fresh session created first (not timed), as ADK's documented call sequence does.
   ADK's server keeps one runner per app, so its model must play a turn from the request alone: a
   stateless two-step model (call, then say) stands in for the ledger's scripted model there.
2. An A2A `message/send` (blocking) round trip against `POST /api/runs/` then polling
   `GET /api/runs/{id}/` every 20 ms until the run settles: both executed by the ledger's workers.

Contenders are timed in turns on one PostgreSQL database (agentledger_bench_adkwire, dropped at
the end).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _benchdb import ROOT as BASE_DIR
from _benchdb import bench_database
from _common import configure_server_env, free_port, interleaved, percentile, row, save_results

SCRIPT = [
    {"call": "lookup_customer", "args": {"email": "jane@example.com"}},
    {"say": "Jane is a customer on the pro plan."},
]
POLL_SECONDS = 0.02


# --- ADK's own API server, the peer ------------------------------------------------------------------


def serve_adk(port: int) -> None:
    """ADK's get_fast_api_app on uvicorn, serving `support` on the bench database's ADK tables."""
    import django

    django.setup()
    from collections.abc import AsyncGenerator

    import uvicorn
    from google.adk.cli.fast_api import get_fast_api_app
    from google.adk.cli.utils.base_agent_loader import BaseAgentLoader
    from google.adk.models.base_llm import BaseLlm
    from google.adk.models.llm_request import LlmRequest
    from google.adk.models.llm_response import LlmResponse
    from google.genai import types

    from agents.adk import adk_database_url
    from agents.registry import get_agent_spec

    class TurnModel(BaseLlm):
        """Plays SCRIPT from the request alone: a call first, the sentence once the call was answered."""

        model: str = "turn"

        async def generate_content_async(self, llm_request: LlmRequest, stream: bool = False
                                         ) -> AsyncGenerator[LlmResponse, None]:
            last = llm_request.contents[-1] if llm_request.contents else None
            answered = bool(last and any(part.function_response for part in last.parts or []))
            if answered:
                part = types.Part(text=SCRIPT[1]["say"])
            else:
                part = types.Part(function_call=types.FunctionCall(
                    id=f"call-{uuid.uuid4().hex[:12]}", name=SCRIPT[0]["call"], args=SCRIPT[0]["args"]))
            yield LlmResponse(content=types.Content(role="model", parts=[part]))

    root = get_agent_spec("support").root.clone(update={"model": TurnModel()})

    class Loader(BaseAgentLoader):
        def load_agent(self, agent_name: str):
            return root

        def list_agents(self) -> list[str]:
            return ["support"]

        def list_agents_detailed(self) -> list[dict]:
            return [{"name": "support", "root_agent_name": "support", "description": "", "language": "python"}]

    with tempfile.TemporaryDirectory() as agents_dir:
        app = get_fast_api_app(
            agents_dir=agents_dir, agent_loader=Loader(), web=False,
            session_service_uri=adk_database_url().render_as_string(hide_password=False),
        )
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- Timing --------------------------------------------------------------------------------------------


def run_sse_turn(client, base: str, *, ledger: bool) -> tuple[float, float]:
    owner, session_id = f"bench-{uuid.uuid4().hex[:8]}", f"s-{uuid.uuid4().hex}"
    created = client.post(f"{base}/apps/support/users/{owner}/sessions", json={"session_id": session_id})
    if created.status_code != 200:
        raise SystemExit(f"{base} did not create a session: {created.status_code} {created.text}")
    body = {"app_name": "support", "user_id": owner, "session_id": session_id, "streaming": False,
            "new_message": {"role": "user", "parts": [{"text": "Who is Jane?"}]}}
    if ledger:
        body["custom_metadata"] = {"params": {"script": SCRIPT}}
    first = last = None
    started = time.perf_counter()
    with client.stream("POST", f"{base}/run_sse", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"{base}/run_sse refused the turn: {response.status_code} {response.read()!r}")
        texts = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                last = time.perf_counter() - started
                first = first if first is not None else last
                texts.append(line)
    if first is None or SCRIPT[1]["say"] not in texts[-1]:
        raise SystemExit(f"{base}/run_sse did not end with the agent's answer: {texts[-1:]}")
    return first, last


def a2a_send(client, url: str) -> float:
    body = {"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": {"message": {
        "kind": "message", "messageId": str(uuid.uuid4()), "role": "user",
        "parts": [{"kind": "text", "text": "Who is Jane?"}],
        "metadata": {"params": {"script": SCRIPT}, "owner_id": f"bench-{uuid.uuid4().hex[:8]}"},
    }}}
    started = time.perf_counter()
    answer = client.post(f"{url}/a2a/support", json=body).json()
    took = time.perf_counter() - started
    if answer.get("result", {}).get("status", {}).get("state") != "completed":
        raise SystemExit(f"message/send did not complete: {answer}")
    return took


def rest_and_poll(client, url: str) -> float:
    started = time.perf_counter()
    created = client.post(f"{url}/api/runs/", json={"agent": "support", "message": "Who is Jane?",
                                                    "owner_id": f"bench-{uuid.uuid4().hex[:8]}",
                                                    "params": {"script": SCRIPT}})
    if created.status_code != 202:
        raise SystemExit(f"POST /api/runs/ refused: {created.status_code} {created.text}")
    run_id = created.json()["run_id"]
    while True:
        status = client.get(f"{url}/api/runs/{run_id}/").json()["status"]
        if status not in ("queued", "running"):
            break
        time.sleep(POLL_SECONDS)
    took = time.perf_counter() - started
    if status != "success":
        raise SystemExit(f"run {run_id} ended {status}")
    return took


def wait_serving(url: str, process: subprocess.Popen, name: str) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise SystemExit(f"{name} did not start: {process.communicate()[1].decode()[-2000:]}") from None
            time.sleep(0.2)


def summary(name: str, values: list[float]) -> str:
    return (f"{name:<44} median {statistics.median(values):7.1f} ms   p95 {percentile(values, 95):7.1f} ms"
            f"   (n={len(values)})")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-adk":
        serve_adk(int(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--block", type=int, default=5)
    args = parser.parse_args()
    if args.turns < 1 or args.warmup < 0 or args.block < 1:
        parser.error("--turns and --block must be positive, --warmup not negative")

    with tempfile.TemporaryDirectory(prefix="adk-wire-") as tmp, bench_database("adkwire") as database:
        env = configure_server_env(Path(tmp), Q_POLL_SECONDS="0.05", RUN_POLL_SECONDS="0.05")
        import httpx
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Permission
        from rest_framework.authtoken.models import Token

        from agents.adk import release_process_resources
        from runs.management.commands.serve import web_command

        user, _ = get_user_model().objects.get_or_create(username="bench")
        user.user_permissions.add(*Permission.objects.filter(codename__in=["act_for_any_owner", "view_agentrun"]))
        token = Token.objects.get_or_create(user=user)[0].key
        child_env = {**os.environ, **env}
        worker_command = "runworker" if (BASE_DIR / "runs/management/commands/runworker.py").exists() else "qcluster"

        ledger_port, adk_port = free_port(), free_port()
        ledger_url, adk_url = f"http://127.0.0.1:{ledger_port}", f"http://127.0.0.1:{adk_port}"
        processes = [
            subprocess.Popen(web_command(host="127.0.0.1", port=ledger_port) + ["--no-access-log"], cwd=BASE_DIR,
                             env=child_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
            subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-adk", str(adk_port)],
                             cwd=BASE_DIR, env=child_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
            subprocess.Popen([sys.executable, "manage.py", worker_command], cwd=BASE_DIR, env=child_env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True),
        ]
        try:
            wait_serving(f"{ledger_url}/admin/login/", processes[0], "the ledger's server")
            wait_serving(f"{adk_url}/list-apps", processes[1], "ADK's api_server")
            headers = {"Authorization": f"Token {token}"}
            with httpx.Client(timeout=60, headers=headers) as client:
                firsts: dict[str, list[float]] = {"ledger": [], "adk": []}
                lasts: dict[str, list[float]] = {"ledger": [], "adk": []}

                def turn(name: str, base: str, ledger: bool):
                    def play() -> None:
                        first, last = run_sse_turn(client, base, ledger=ledger)
                        firsts[name].append(first * 1000)
                        lasts[name].append(last * 1000)
                    return play

                interleaved({"ledger": turn("ledger", f"{ledger_url}/adk", True),
                             "adk": turn("adk", adk_url, False)}, count=args.turns, block=args.block, warmup=args.warmup)
                for kind in (firsts, lasts):
                    for name in kind:
                        del kind[name][:args.warmup]
                roundtrips = interleaved({"a2a": lambda: a2a_send(client, ledger_url),
                                          "rest": lambda: rest_and_poll(client, ledger_url)},
                                         count=args.turns, block=args.block, warmup=args.warmup)
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
            release_process_resources()

    print(f"ADK's wires on the ledger ({database}, one turn: lookup_customer then a sentence)")
    print(summary("/adk/run_sse, first event (ledger)", firsts["ledger"]))
    print(summary("/run_sse, first event (ADK's api_server)", firsts["adk"]))
    print(summary("/adk/run_sse, last event (ledger)", lasts["ledger"]))
    print(summary("/run_sse, last event (ADK's api_server)", lasts["adk"]))
    print(summary("A2A message/send round trip", roundtrips["a2a"]))
    print(summary("POST /api/runs/ + polling", roundtrips["rest"]))
    median = statistics.median
    print(f"ratio ledger/ADK: first event {median(firsts['ledger']) / median(firsts['adk']):.2f}x, "
          f"last event {median(lasts['ledger']) / median(lasts['adk']):.2f}x; "
          f"A2A/REST {median(roundtrips['a2a']) / median(roundtrips['rest']):.2f}x")
    first_ratio = median(firsts["ledger"]) / median(firsts["adk"])
    last_ratio = median(lasts["ledger"]) / median(lasts["adk"])
    save_results("adk_wire", [
        row("/adk/run_sse first event, median", median(firsts["ledger"]), "ms",
            peer="ADK's api_server /run_sse", peer_value=median(firsts["adk"])),
        row("/adk/run_sse first event, multiple of ADK's api_server", round(first_ratio, 2), "×",
            target="≤ 1.5 (moonshot 1.2)"),
        row("/adk/run_sse last event, median", median(lasts["ledger"]), "ms",
            peer="ADK's api_server /run_sse", peer_value=median(lasts["adk"])),
        row("/adk/run_sse last event, multiple of ADK's api_server", round(last_ratio, 2), "×",
            target="≤ 1.5 (moonshot 1.2)"),
        row("A2A message/send round trip, median", median(roundtrips["a2a"]), "ms",
            peer="POST /api/runs/ + polling", peer_value=median(roundtrips["rest"])),
    ], turns=args.turns, warmup=args.warmup)


if __name__ == "__main__":
    main()
