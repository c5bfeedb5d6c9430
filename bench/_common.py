"""Statistics and the one results format shared by every benchmark.

Benchmarks are scripts, not tests: each prints its figures and the ratio against its peer
measured in the same run, and stores its headline figures with `save_results` under
bench/results/<name>.json, which bench/report.py gathers into one table. The database a
benchmark runs on comes from `_benchdb.bench_database`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
PROJECT_DIR = BENCH_DIR.parent
# The smoke run writes elsewhere: its tiny sizes must not replace the real figures.
RESULTS_DIR = Path(os.environ.get("BENCH_RESULTS_DIR") or BENCH_DIR / "results")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def configure_server_env(var_dir: Path, **extra: str) -> dict[str, str]:
    """The production-like environment a benchmark's server runs in (DEBUG off, mail kept in memory,
    quiet logs), set on this process too, so that the processes it starts inherit it."""
    env = {
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "VAR_DIR": str(var_dir),
        "EMAIL_BACKEND": "django.core.mail.backends.locmem.EmailBackend",
        "LOG_LEVEL": "WARNING",
        "DEBUG": "false",
        **extra,
    }
    os.environ.update(env)
    return env


def start_runworker(**env: str) -> subprocess.Popen:
    """`manage.py runworker` in its own process group, with this environment and `env` on top."""
    return subprocess.Popen(
        [sys.executable, "manage.py", "runworker"], cwd=PROJECT_DIR, env=dict(os.environ, **env),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


def stop_runworker(process: subprocess.Popen, *, drain_seconds: float = 60) -> None:
    """SIGTERM (it drains its runs), then whatever is left of its process group is killed."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=drain_seconds)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: list[float]) -> dict:
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "mean": statistics.fmean(values),
    }


def interleaved(contenders: dict, *, count: int, block: int, warmup: int) -> dict[str, list[float]]:
    """ms per call of each contender, `count` calls each, in turns of `block` after `warmup`
    untimed calls: a change in the machine's load falls on every contender alike."""
    for _ in range(warmup):
        for run in contenders.values():
            run()
    timings: dict[str, list[float]] = {key: [] for key in contenders}
    done = 0
    while done < count:
        turn = min(block, count - done)
        for key, run in contenders.items():
            for _ in range(turn):
                started = time.perf_counter()
                run()
                timings[key].append((time.perf_counter() - started) * 1000)
        done += turn
    return timings


def machine() -> str:
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    return f"{os.cpu_count()} cores, {cpu}, Python {platform.python_version()}"


_TARGET = re.compile(r"^\s*(≤|<=|<|≥|>=|>|==|=)\s*([-+]?[\d,]*\.?\d+)")
_COMPARE = {
    "≤": float.__le__, "<=": float.__le__, "<": float.__lt__,
    "≥": float.__ge__, ">=": float.__ge__, ">": float.__gt__,
    "=": float.__eq__, "==": float.__eq__,
}


def target_met(value, target) -> bool | None:
    """Whether `value` meets a target written as "≤ 1.10", "= 0", "≥ 100 (goal)"; None if no target."""
    if target in (None, "") or value is None:
        return None
    match = _TARGET.match(str(target))
    if not match:
        return None
    return _COMPARE[match.group(1)](float(value), float(match.group(2).replace(",", "")))


def row(metric: str, value, unit: str = "", *, peer: str | None = None, peer_value=None, ratio=None,
        target: str | None = None, correctness: bool = False) -> dict:
    """One headline figure. `ratio` is value / peer_value (computed when both are numbers): the
    figure as a multiple of the peer's, so 0.1 for a time means ten times faster than the peer.

    `correctness` marks a target that must hold at any size (no 5xx, no duplicate effect), as
    opposed to a speed target: `report.py --strict` fails when one is missed."""
    if ratio is None and isinstance(value, (int, float)) and isinstance(peer_value, (int, float)) and peer_value:
        ratio = value / peer_value
    return {
        "metric": metric, "value": value, "unit": unit, "peer": peer, "peer_value": peer_value,
        "ratio": ratio, "target": target, "met": target_met(value, target), "correctness": correctness,
    }


def save_results(name: str, rows: list[dict], **extra) -> Path:
    """Write bench/results/<name>.json: {"benchmark", "date", "machine", "postgres", "commit", "rows", ...extra}.

    rows: [{"metric", "value", "unit", "peer", "peer_value", "ratio", "target", "met"}] (see `row`;
    plain dicts with some keys missing are accepted, "met" is then derived from "target").
    """
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_DIR, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    rows = [{**r, "met": r["met"] if r.get("met") is not None else target_met(r.get("value"), r.get("target"))}
            for r in rows]
    payload = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "postgres": _postgres_version(),
        "commit": commit,
        "rows": rows,
        **extra,
    }
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"results: {path}")
    return path


def _postgres_version() -> str | None:
    if os.environ.get("BENCH_POSTGRES_VERSION"):
        return os.environ["BENCH_POSTGRES_VERSION"]
    if "django" not in sys.modules:
        return None
    try:
        from django.db import connection

        if connection.vendor != "postgresql":
            return None
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            return cursor.fetchone()[0]
    except Exception:  # the results matter more than this label
        return None


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for index, row in enumerate(cells):
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)))
        if index == 0:
            print("  ".join("-" * w for w in widths))
