"""Time to first streamed event of a chat turn: through the live server vs the ADK runner in-process.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/chat_ttfe.py [--turns 40]

The server path is what a client sees: an HTTP POST to `/api/chat/` on the ASGI server that
`manage.py serve` starts (token authentication, the run written before it executes, the claim,
the heartbeat, the journal, the retrying model), timed from sending the request to receiving the
first ADK event of the stream. Its peer calls ADK's runner directly in this process with the same
agent and the same script on the same database, timed from creating the session to the first
event. Both play the same script and read their whole turn, on their own PostgreSQL database
(agentledger_bench_chat, dropped at the end).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from _benchdb import ROOT as BASE_DIR
from _benchdb import bench_database
from _common import configure_server_env, free_port, percentile, row, save_results

SCRIPT = [
    {"call": "lookup_customer", "args": {"email": "jane@example.com"}},
    {"say": "Jane is a customer on the pro plan."},
]


def server_turn(url: str, token: str) -> tuple[float, float]:
    import httpx

    body = {"agent": "support", "owner_id": f"bench-{uuid.uuid4().hex[:8]}", "message": "Who is Jane?",
            "params": {"script": SCRIPT}}
    first = head = None
    with httpx.Client(timeout=30) as client:
        started = time.perf_counter()
        with client.stream("POST", f"{url}/api/chat/", json=body, headers={"Authorization": f"Token {token}"}) as r:
            if r.status_code != 200:
                raise SystemExit(f"the server refused the turn: {r.status_code} {r.read()!r}")
            for line in r.iter_lines():
                if head is None and line == "event: run":
                    head = time.perf_counter() - started
                if first is None and line == "event: adk":
                    first = time.perf_counter() - started
            # The whole stream is read, as a client would.
    if first is None:
        raise SystemExit("the stream carried no ADK event")
    return first, head


async def direct_turn() -> float:
    from google.adk.agents.run_config import RunConfig
    from google.adk.apps import App
    from google.adk.runners import Runner
    from google.genai import types

    from agents.adk import session_service
    from agents.registry import build_agent, get_agent_spec

    spec = get_agent_spec("support")
    owner, session_id = f"bench-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    runner = Runner(app=App(name=spec.name, root_agent=build_agent(spec, params={"script": SCRIPT})),
                    session_service=session_service())
    first = None
    started = time.perf_counter()
    await session_service().create_session(app_name=spec.name, user_id=owner, session_id=session_id)
    message = types.Content(role="user", parts=[types.Part(text="Who is Jane?")])
    async for _event in runner.run_async(user_id=owner, session_id=session_id, new_message=message,
                                         run_config=RunConfig()):
        if first is None:
            first = time.perf_counter() - started
    await runner.close()
    return first


def summary(name: str, values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return (f"{name:<28} median {statistics.median(ms):7.1f} ms   p95 {percentile(ms, 95):7.1f} ms   "
            f"min {min(ms):6.1f} ms   (n={len(ms)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if args.turns < 1 or args.warmup < 0:
        parser.error("--turns must be positive, --warmup not negative")

    with tempfile.TemporaryDirectory(prefix="chat-ttfe-") as tmp, bench_database("chat"):
        env = configure_server_env(Path(tmp))
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Permission
        from django.db import connection
        from rest_framework.authtoken.models import Token

        from agents.adk import release_process_resources, run_coroutine
        from runs.management.commands.serve import web_command

        vendor = connection.vendor
        user, _ = get_user_model().objects.get_or_create(username="bench")
        # A service account: each turn acts for an owner of its own (runs.act_for_any_owner).
        user.user_permissions.add(Permission.objects.get(codename="act_for_any_owner"))
        token = Token.objects.get_or_create(user=user)[0].key

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(web_command(host="127.0.0.1", port=port) + ["--no-access-log"], cwd=BASE_DIR,
                                  env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            import httpx

            deadline = time.monotonic() + 120
            while True:
                try:
                    httpx.get(f"{url}/admin/login/", timeout=2)
                    break
                except httpx.TransportError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        # Its stderr ends only when it does: stop it before reading what it said.
                        server.kill()
                        said = server.communicate()[1].decode()[-2000:]
                        raise SystemExit(f"the server did not start: {said}") from None
                    time.sleep(0.2)

            for _ in range(args.warmup):
                server_turn(url, token)
                run_coroutine(direct_turn())
            via_server, heads, direct = [], [], []
            # Interleaved, so both paths see the same machine load.
            for _ in range(args.turns):
                first, head = server_turn(url, token)
                via_server.append(first)
                heads.append(head)
                direct.append(run_coroutine(direct_turn()))
        finally:
            server.terminate()
            server.wait(timeout=30)
            release_process_resources()

    print(f"Time to first streamed event of a chat turn ({vendor}, script: lookup_customer then say)")
    print(summary("live server (HTTP, SSE)", via_server))
    print(summary("  of which: run written, 1st byte", heads))
    print(summary("ADK runner in-process", direct))
    ratio_median = statistics.median(via_server) / statistics.median(direct)
    ratio_p95 = percentile(via_server, 95) / percentile(direct, 95)
    print(f"ratio server/direct: median {ratio_median:.2f}x   p95 {ratio_p95:.2f}x")
    ms = [[v * 1000 for v in values] for values in (via_server, heads, direct)]
    save_results(
        "chat_ttfe",
        [
            row("first streamed event via the live server, median", statistics.median(ms[0]), "ms",
                peer="ADK runner in-process", peer_value=statistics.median(ms[2])),
            row("first streamed event via the live server, p95", percentile(ms[0], 95), "ms",
                peer="ADK runner in-process", peer_value=percentile(ms[2], 95)),
            row("run written, first byte, median", statistics.median(ms[1]), "ms"),
        ],
        turns=args.turns, warmup=args.warmup,
    )


if __name__ == "__main__":
    main()
