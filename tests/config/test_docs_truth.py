"""The map stays true: what the manual (README.md and docs/), the API's descriptions and
docs/architecture.md say about the code is read from the code and held to it."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
from drf_spectacular.generators import SchemaGenerator

from runs.refusals import REPLAY_REFUSAL_ORDER, RESUME_REFUSAL_ORDER
from runs.rules import replay, resume

ROOT = Path(__file__).resolve().parents[2]
# The rules are stated once, on the page every reader is sent to; the settings on the operators'.
RUNS_PAGE = (ROOT / "docs" / "runs.md").read_text()
CONFIGURATION_PAGE = (ROOT / "docs" / "configuration.md").read_text()
MANUAL_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
CODE_DIRS = ("config", "agents", "memory", "runs", "bench")
MAX_LINES = 420

REPLAY_CODES = [refusal.code for refusal in REPLAY_REFUSAL_ORDER]
RESUME_CODES = [refusal.code for refusal in RESUME_REFUSAL_ORDER]


def source_files() -> list[Path]:
    return sorted(
        path
        for folder in CODE_DIRS
        for path in (ROOT / folder).rglob("*.py")
        if "migrations" not in path.parts and "__pycache__" not in path.parts
    )


def codes_in(text: str, known: list[str]) -> list[str]:
    """The known codes named in `text` (in backticks), each once, in the order they first appear."""
    found = [code for code in re.findall(r"`([a-z_]+)`", text) if code in known]
    return list(dict.fromkeys(found))


def section(text: str, start: str, end: str) -> str:
    begin = text.index(start)
    return text[begin : text.index(end, begin + len(start))]


def table_after(text: str, marker: str) -> list[list[str]]:
    """The rows (cells) of the first Markdown table after `marker`, header and rule left out."""
    lines = text[text.index(marker) :].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def refusal_classes_in_order_of(function) -> list[str]:
    """The refusal classes a rule function (and the helpers it calls in its module) constructs, in source order."""
    module = inspect.getmodule(function)
    tree = ast.parse(inspect.getsource(module))
    functions = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    seen: list[str] = []

    def visit(name: str, visited: set[str]) -> None:
        if name in visited:
            return
        visited.add(name)
        calls = sorted(
            (node for node in ast.walk(functions[name]) if isinstance(node, ast.Call)),
            key=lambda node: (node.lineno, node.col_offset),
        )
        for node in calls:
            if isinstance(node.func, ast.Name):
                callee = node.func.id
                if callee in functions:
                    visit(callee, visited)
                elif callee not in seen:
                    seen.append(callee)

    visit(function.__name__, set())
    return seen


# --- The replay and resume orders -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "order"),
    [(replay.decide_on_facts, REPLAY_REFUSAL_ORDER), (resume.decide_resume_on_facts, RESUME_REFUSAL_ORDER)],
)
def test_the_rules_check_their_refusals_in_the_declared_order(rule, order):
    names = {refusal.__name__ for refusal in order}
    constructed = [name for name in refusal_classes_in_order_of(rule) if name in names]
    assert constructed == [refusal.__name__ for refusal in order]


def test_the_manuals_replay_table_follows_the_order():
    rows = table_after(RUNS_PAGE, "`runs.services.run.replay_run(…)`, checked in this order")
    assert codes_in(" ".join(row[1] for row in rows), REPLAY_CODES) == REPLAY_CODES


def test_the_manuals_resume_table_follows_the_order():
    rows = table_after(RUNS_PAGE, "`runs.rules.resume.decide_resume`, in this order")
    assert codes_in(" ".join(row[1] for row in rows), RESUME_CODES) == RESUME_CODES


def test_the_architecture_says_both_orders():
    replay_rules = section(ARCHITECTURE, "`decide(run, force=…)`", "\n\n")
    assert codes_in(replay_rules, REPLAY_CODES) == REPLAY_CODES
    resume_rules = section(ARCHITECTURE, "`decide_resume(run)`", "\n\n")
    assert codes_in(resume_rules, RESUME_CODES) == RESUME_CODES


@pytest.mark.django_db  # the schema lists the stored workflows' names
def test_the_api_describes_both_orders():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    replay_op = schema["paths"]["/api/runs/{run_id}/replay/"]["post"]
    resume_op = schema["paths"]["/api/runs/{run_id}/resume/"]["post"]
    assert codes_in(replay_op["description"], REPLAY_CODES) == REPLAY_CODES
    assert codes_in(resume_op["description"], RESUME_CODES) == RESUME_CODES
    decisions = schema["components"]["schemas"]
    replay_code = decisions["ReplayDecision"]["properties"]["code"]["description"]
    resume_code = decisions["ResumeDecision"]["properties"]["code"]["description"]
    assert [code for code in re.findall(r"[a-z_]+", replay_code) if code in REPLAY_CODES] == REPLAY_CODES
    assert [code for code in re.findall(r"[a-z_]+", resume_code) if code in RESUME_CODES] == RESUME_CODES


# --- The configuration table ----------------------------------------------------------------------


def settings_variables() -> set[str]:
    """Every environment variable config/settings.py reads (the config.env readers, os.environ)."""
    tree = ast.parse((ROOT / "config" / "settings.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            on_environ = isinstance(func, ast.Attribute) and getattr(func.value, "attr", None) == "environ"
            if name.startswith("env_") or name == "getenv" or (name == "get" and on_environ):
                names.add(node.args[0].value)
        elif isinstance(node, ast.Subscript) and getattr(node.value, "attr", None) == "environ":
            names.add(node.slice.value)
    return names


def test_every_variable_the_settings_read_is_in_the_configuration_table():
    rows = table_after(CONFIGURATION_PAGE, "| variable |")
    documented = {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row[0])}
    read = settings_variables()
    assert len(read) > 50  # the reader found the settings' variables, not nothing
    assert sorted(read - documented) == []


# --- The rest of the map --------------------------------------------------------------------------


def test_every_cited_section_of_the_architecture_exists():
    headings = set(re.findall(r"^#+ (.+)$", ARCHITECTURE, re.M)) | set(re.findall(r"\*\*([^*]+?)\.\*\*", ARCHITECTURE))
    cited = {
        (path.relative_to(ROOT), title)
        for path in [*source_files(), *MANUAL_PAGES]
        for title in re.findall(r'docs/architecture\.md, "([^"]+)"', path.read_text())
    }
    assert cited, "no citation found: the pattern is wrong"
    assert sorted((str(path), title) for path, title in cited if title not in headings) == []


def test_every_module_over_the_line_limit_is_named_in_the_architecture():
    named = section(ARCHITECTURE, "### Modules over 420 lines", "\n### ")
    long = [
        str(path.relative_to(ROOT))
        for path in source_files()
        if len(path.read_text().splitlines()) > MAX_LINES
    ]
    assert [module for module in long if f"`{module}`" not in named] == []


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or getattr(test, "attr", None) == "TYPE_CHECKING"


def function_level_imports() -> set[tuple[str, tuple[str, ...]]]:
    """(importing module, the names its import may be listed by) for every import inside a function."""
    found: set[tuple[str, tuple[str, ...]]] = set()
    for path in source_files():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom):
                    # `from runs import journal` is listed as `runs.ledger.journal`; `from a.b import c` as `a.b`.
                    for alias in node.names:
                        found.add((module, (node.module or "", f"{node.module}.{alias.name}")))
                elif isinstance(node, ast.Import):
                    found.update((module, (alias.name,)) for alias in node.names)
    return found


def test_every_function_level_import_is_one_the_architecture_lists():
    listed = section(ARCHITECTURE, "### Imports inside functions", "\n### ")
    named = set(re.findall(r"`([A-Za-z_][\w.]*)`", listed))
    unlisted = sorted(
        (importer, names[-1])
        for importer, names in function_level_imports()
        if not importer.startswith("bench.")  # scripts import what the part they measure needs, when it runs
        and (importer not in named or not named.intersection(names))
    )
    assert unlisted == []
