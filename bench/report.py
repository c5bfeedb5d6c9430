"""Every benchmark's headline figures in one table, from bench/results/*.json.

    python bench/report.py [--results bench/results] [--markdown FILE] [--docs PAGE] [--strict]

Each benchmark script writes bench/results/<name>.json with `_common.save_results`; this reads
them all (whatever scripts ran, including ones added later) and prints one table: benchmark,
metric, value, unit, peer, ratio (value / peer value), target and whether it was met. The crash
matrix (crash_matrix.json, written by `make bench-crash`) is printed as its point × outcome table.
--markdown also writes both as Markdown; --docs puts the same Markdown into docs/benchmarks.md,
between its two `make bench` marker lines, so the page's table is always one run's. --strict
exits non-zero when a correctness target (no 5xx, no duplicate effect, replays accepted: a row
saved with `correctness=True`) was missed, whatever the size; speed targets only print.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _common import RESULTS_DIR, print_table

HEADERS = ["benchmark", "metric", "value", "unit", "peer", "ratio", "target", "met?"]


def number(value) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1:
        return f"{value:,.0f}"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 0.01:
        return f"{value:.2f}"
    return f"{value:.3g}"


def met_label(met) -> str:
    return {True: "yes", False: "NO", None: ""}[met]


def load(results_dir: Path) -> tuple[list[dict], dict | None, list[str]]:
    benchmarks, crash, problems = [], None, []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            problems.append(f"{path.name}: unreadable ({error})")
            continue
        if path.stem == "crash_matrix":
            crash = data
        elif isinstance(data, dict) and isinstance(data.get("rows"), list):
            benchmarks.append(data)
        else:
            problems.append(f"{path.name}: not a benchmark results file (no rows)")
    return benchmarks, crash, problems


def table_rows(benchmarks: list[dict]) -> list[list[str]]:
    rows = []
    for data in benchmarks:
        name = data.get("benchmark", "?")
        for item in data["rows"]:
            peer = item.get("peer") or ""
            if peer and item.get("peer_value") is not None:
                peer = f"{peer}: {number(item['peer_value'])}"
            ratio = item.get("ratio")
            rows.append([
                name,
                str(item.get("metric", "")),
                number(item.get("value")),
                str(item.get("unit") or ""),
                peer,
                f"{number(ratio)}×" if isinstance(ratio, (int, float)) else "",
                str(item.get("target") or ""),
                met_label(item.get("met")),
            ])
    return rows


def crash_rows(crash: dict) -> list[list[str]]:
    rows = []
    for key, point in sorted(crash.get("points", {}).items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else kv[0]):
        for outcome, count in sorted(point.get("outcomes", {}).items()):
            rows.append([f"({key}) {point.get('label', '')}", outcome, str(count)])
    return rows


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def runs_line(benchmarks: list[dict]) -> list[str]:
    return [
        f"{data.get('benchmark')}: {data.get('date', '?')}, commit {data.get('commit') or '?'}"
        + (f", PostgreSQL {data['postgres']}" if data.get("postgres") else "")
        for data in benchmarks
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="directory of the results files")
    parser.add_argument("--markdown", type=Path, help="also write the tables as Markdown to this file")
    parser.add_argument("--docs", type=Path, help="replace the table between the marker lines of this page")
    parser.add_argument("--strict", action="store_true",
                        help="exit non-zero when a correctness target (one that holds at any size) is missed")
    args = parser.parse_args()

    benchmarks, crash, problems = load(args.results)
    if not benchmarks and crash is None:
        print(f"No results in {args.results}: run `make bench` (or a bench/*.py script) first.", file=sys.stderr)
        return 1
    rows = table_rows(benchmarks)
    machines = sorted({data.get("machine", "?") for data in benchmarks})
    if rows:
        print_table(HEADERS, rows)
        print()
        for line in runs_line(benchmarks):
            print(f"  {line}")
        print(f"  machine: {'; '.join(machines)}")
    if crash is not None:
        print(f"\nCrash matrix ({crash.get('repeats', '?')} repeats per point; point × outcome, counts):")
        print_table(["point", "outcome", "count"], crash_rows(crash))
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    missed = [row for row in rows if row[-1] == "NO"]
    if missed:
        print(f"\n{len(missed)} target(s) missed: " + "; ".join(f"{r[0]} {r[1]} = {r[2]} (target {r[6]})" for r in missed))
    broken = [
        f"{data.get('benchmark', '?')} {item.get('metric')} = {item.get('value')} (target {item.get('target')})"
        for data in benchmarks for item in data["rows"] if item.get("correctness") and item.get("met") is not True
    ]
    if broken:
        print(f"\n{len(broken)} correctness target(s) missed: " + "; ".join(broken), file=sys.stderr)

    if args.markdown or args.docs:
        parts = []
        if rows:
            parts += ["## All benchmarks", "", markdown_table(HEADERS, rows), "",
                      "Ratio is value ÷ peer value (below 1 for a time: faster than the peer).", ""]
            parts += [f"- {line}" for line in runs_line(benchmarks)] + [""]
        if crash is not None:
            parts += [f"## Crash matrix ({crash.get('repeats', '?')} repeats per point)", "",
                      markdown_table(["point", "outcome", "count"], crash_rows(crash)), ""]
        markdown = "\n".join(parts)
        if args.markdown:
            args.markdown.write_text(markdown)
            print(f"\nwrote {args.markdown}")
        if args.docs:
            replace_between_markers(args.docs, markdown)
            print(f"updated {args.docs}")
    return 1 if args.strict and broken else 0


DOCS_START = "<!-- make bench writes what follows, up to the closing marker (bench/report.py --docs) -->"
DOCS_END = "<!-- end of what make bench writes -->"


def replace_between_markers(page: Path, markdown: str) -> None:
    text = page.read_text()
    start, end = text.find(DOCS_START), text.find(DOCS_END)
    if start < 0 or end < start:
        raise SystemExit(f"{page} has no marker lines to write between:\n{DOCS_START}\n{DOCS_END}")
    # The page's own headings are kept: the generated part starts below its "## All benchmarks".
    body = markdown.removeprefix("## All benchmarks\n\n")
    page.write_text(text[: start + len(DOCS_START)] + "\n\n" + body.strip() + "\n\n" + text[end:])


if __name__ == "__main__":
    sys.exit(main())
