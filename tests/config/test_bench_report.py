"""`bench/report.py`: one table from every results file, and `--strict` for `make bench-smoke`.

A speed target missed at smoke size only prints; a correctness target (no 5xx, no duplicate
effect) missed at any size fails the command, so CI's smoke run catches a benchmark that rotted
into measuring refusals or errors.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import BASE_DIR


def _results(tmp_path, *rows: dict):
    (tmp_path / "replay_load.json").write_text(json.dumps({"benchmark": "replay_load", "rows": list(rows)}))
    return tmp_path


def _report(results, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/report.py", "--results", str(results), *flags],
        cwd=BASE_DIR, capture_output=True, text=True, timeout=60,
    )


SLOW = {"metric": "GET run detail p50", "value": 900, "unit": "ms", "target": "≤ 100", "met": False}
NO_5XX = {"metric": "5xx responses", "value": 0, "target": "= 0", "met": True, "correctness": True}
SOME_5XX = {"metric": "5xx responses", "value": 3, "target": "= 0", "met": False, "correctness": True}


def test_a_missed_speed_target_prints_and_passes_even_when_strict(tmp_path):
    done = _report(_results(tmp_path, SLOW, NO_5XX), "--strict")
    assert done.returncode == 0, done.stderr
    assert "1 target(s) missed: replay_load GET run detail p50" in done.stdout


def test_a_missed_correctness_target_fails_when_strict(tmp_path):
    results = _results(tmp_path, SLOW, SOME_5XX)
    strict = _report(results, "--strict")
    assert strict.returncode == 1
    assert "1 correctness target(s) missed: replay_load 5xx responses = 3 (target = 0)" in strict.stderr
    assert _report(results).returncode == 0  # make bench prints it and goes on to write the table
