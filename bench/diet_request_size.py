"""Benchmark: the size of the request sent to the model after 5 image turns, with and without
the memory diet (PostgreSQL; the runs go through the real executor and ADK session service).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/diet_request_size.py

Five chat turns in one session, each attaching a 750 KB photo (incompressible bytes). The size
is the request contents as JSON (what google-genai serialises, images as base64). The peer is
the same conversation with the diet's callback removed. Creates and drops agentledger_bench_diet.
"""

from __future__ import annotations

import io
import json
import os
import uuid

from _benchdb import bench_database
from _common import row, save_results

os.environ.setdefault("LOG_LEVEL", "ERROR")

TURNS = 5
IMAGE_BYTES = 750 * 1024


def request_bytes(request) -> int:
    contents = [content.model_dump(mode="json", exclude_none=True) for content in request.contents]
    return len(json.dumps(contents).encode())


def conversation(images: list[bytes]) -> list[int]:
    from agents import scripted
    from runs.execution import executor
    from runs.services import run as services

    sizes: list[int] = []
    seen: list = []
    scripted.request_observers.append(seen.append)
    try:
        session_id = str(uuid.uuid4())
        for turn, image in enumerate(images, start=1):
            run = services.start_run(
                agent_name="support", owner_id="bench", message=f"Turn {turn}: what does this photo show?",
                file=io.BytesIO(image), file_name=f"photo-{turn}.jpg", session_id=session_id,
                params={"script": [{"say": f"Photo {turn} shows a damaged parcel."}]}, enqueue=False,
            )
            assert executor.execute(run.run_id) == "success"
            sizes.append(request_bytes(seen[-1]))
    finally:
        scripted.request_observers.remove(seen.append)
    return sizes


def main() -> None:
    with bench_database("diet"):
        from agents import diet

        images = [b"\xff\xd8\xff\xe0" + os.urandom(IMAGE_BYTES - 4) for _ in range(TURNS)]
        with_diet = conversation(images)
        # Each run's tree puts diet.strip_old_payloads first (agents/run_tree.py): a callback that
        # leaves the request as it is stands for no diet.
        kept = diet.strip_old_payloads
        diet.strip_old_payloads = lambda callback_context, llm_request: None
        try:
            without_diet = conversation(images)
        finally:
            diet.strip_old_payloads = kept

        print(f"\nrequest contents sent to the model, {TURNS} turns each with a {IMAGE_BYTES // 1024} KB image")
        print(f"  {'turn':>4} {'with diet':>14} {'without diet':>14}")
        for turn, (a, b) in enumerate(zip(with_diet, without_diet, strict=True), start=1):
            print(f"  {turn:>4} {a:>14,} {b:>14,}")
        print("\nresults")
        print(f"  turn {TURNS} request: {with_diet[-1]:,} bytes with the diet, {without_diet[-1]:,} without; "
              f"ratio without / with: {without_diet[-1] / with_diet[-1]:.2f}x")
        print(f"  all {TURNS} turns: {sum(with_diet):,} bytes with the diet, {sum(without_diet):,} without; "
              f"ratio {sum(without_diet) / sum(with_diet):.2f}x")
        save_results(
            "diet_request_size",
            [
                row(f"request at turn {TURNS}, {IMAGE_BYTES // 1024} KB image per turn", with_diet[-1], "bytes",
                    peer="without the diet", peer_value=without_diet[-1]),
                row(f"all {TURNS} requests", sum(with_diet), "bytes", peer="without the diet",
                    peer_value=sum(without_diet)),
            ],
            with_diet=with_diet, without_diet=without_diet,
        )


if __name__ == "__main__":
    main()
