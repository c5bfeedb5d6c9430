"""The manual stays true as a whole: every page reachable from the README, every relative link and
anchor resolving, the README within its budget, the configuration table the settings' own list,
and the constants the prose states (file modes, defaults) the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from config.lib.files import DIR_MODE, FILE_MODE
from tests.config.test_docs_truth import settings_variables, table_after
from tests.helpers import read_settings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_BUDGET_BYTES = 20 * 1024

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(path: Path) -> str:
    """The page without its fenced blocks: what is in a code block is an example, not a link."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip()).lower()
    # GitHub keeps letters, digits, hyphens, underscores and spaces; `_` was markup above only
    # where it emphasised, which headings here never do inside words.
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", prose(path), re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[tuple[str, Path, str]]:
    """(as written, the file it points at, its anchor) for every link that stays in the repository."""
    found = []
    for target in LINK.findall(prose(path)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        found.append((target, resolved, anchor))
    return found


def test_the_pages_are_found():
    names = {path.relative_to(ROOT).as_posix() for path in pages()}
    assert {"README.md", "docs/architecture.md", "docs/benchmarks.md", "docs/configuration.md", "docs/desk.md"} <= names


@pytest.mark.parametrize("page", pages(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target, resolved, anchor in relative_links(page):
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert broken == []


def test_no_page_under_docs_is_an_orphan():
    reached = {README.resolve()}
    todo = [README.resolve()]
    while todo:
        page = todo.pop()
        for _, resolved, _ in relative_links(page):
            if resolved.suffix == ".md" and resolved.exists() and resolved not in reached:
                reached.add(resolved)
                todo.append(resolved)
    orphans = [str(path.relative_to(ROOT)) for path in DOCS.rglob("*.md") if path.resolve() not in reached]
    assert orphans == []


def test_every_image_a_page_shows_exists_and_the_readme_shows_one():
    shown = [resolved for page in pages() for target, resolved, _ in relative_links(page) if resolved.suffix == ".png"]
    assert shown and all(path.exists() for path in shown)
    assert any(resolved.suffix == ".png" for _, resolved, _ in relative_links(README))


def test_the_readme_stays_within_its_budget():
    assert len(README.read_bytes()) <= README_BUDGET_BYTES


# --- The configuration table ----------------------------------------------------------------------

CONFIGURATION = DOCS / "configuration.md"
CODE_DIRS = ("config", "agents", "memory", "runs")
# Read by someone other than config/settings.py: where each is read.
READ_ELSEWHERE = {
    "GOOGLE_GEMINI_BASE_URL": "google-genai",
    "PORT": "runs/management/commands/serve.py",
    "HOST": "runs/management/commands/serve.py",
    "ADMIN_PASSWORD": "runs/management/commands/ensure_admin.py",
    "PROMETHEUS_MULTIPROC_DIR": "runs/upkeep/metrics.py",
}
ENVIRONMENT_READ = re.compile(r'os\.environ(?:\.get)?[\[(]"([A-Z][A-Z0-9_]+)"|"([A-Z][A-Z0-9_]+)" in os\.environ|getenv\("([A-Z][A-Z0-9_]+)"')


def variables_read_outside_the_settings() -> set[str]:
    names: set[str] = set()
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if path != ROOT / "config" / "settings.py" and "migrations" not in path.parts:
                names.update(name for match in ENVIRONMENT_READ.findall(path.read_text()) for name in match if name)
    return names


def configuration_rows() -> list[list[str]]:
    return table_after(CONFIGURATION.read_text(), "| variable |")


def documented_variables() -> set[str]:
    return {name for row in configuration_rows() for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row[0])}


def test_every_variable_in_the_configuration_table_is_one_the_code_reads():
    assert sorted(documented_variables() - settings_variables()) == sorted(READ_ELSEWHERE)
    for name, where in READ_ELSEWHERE.items():
        if where == "google-genai":
            import google.genai

            source = "".join(path.read_text() for path in Path(google.genai.__file__).parent.glob("*.py"))
        else:
            source = (ROOT / where).read_text()
        assert f'"{name}"' in source or f"'{name}'" in source, (name, where)


def test_every_variable_the_code_reads_outside_the_settings_is_in_the_table():
    read = variables_read_outside_the_settings()
    assert "ADMIN_PASSWORD" in read  # the reader found them, not nothing
    assert sorted(read - documented_variables()) == []


def fresh_settings():
    """config/settings.py as a bare shell with DEBUG on reads it: every default, no test override."""
    return read_settings(drop=tuple(settings_variables() - {"DEBUG"}), DEBUG="true")


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def test_the_defaults_the_configuration_table_states_are_the_settings_defaults():
    module = fresh_settings()
    checked, wrong = 0, []
    for row in configuration_rows():
        names = re.findall(r"`([A-Z][A-Z0-9_]+)`", row[0])
        defaults = re.findall(r"`([^`]+)`", row[1])
        if len(names) != 1 or not defaults or number(defaults[0]) is None or not hasattr(module, names[0]):
            continue
        value = getattr(module, names[0])
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        checked += 1
        if number(defaults[0]) != value:
            wrong.append((names[0], defaults[0], value))
    assert checked > 20  # the reader found the numeric defaults, not nothing
    assert wrong == []


def test_a_setting_named_with_its_value_in_prose_has_that_default():
    """`NAME` (value) anywhere in the manual: the default the settings give NAME."""
    module = fresh_settings()
    checked, wrong = 0, []
    for page in pages():
        for name, value in re.findall(r"`([A-Z][A-Z0-9_]+)` \((\d+(?:\.\d+)?)(?: s| ms)?\)", prose(page)):
            if not hasattr(module, name):
                continue
            checked += 1
            if float(value) != getattr(module, name):
                wrong.append((str(page.relative_to(ROOT)), name, value, getattr(module, name)))
    assert checked > 5
    assert wrong == []


# --- File modes -----------------------------------------------------------------------------------


def test_the_file_modes_the_manual_states_are_the_codes():
    modes = {f"0{FILE_MODE:o}", f"0{DIR_MODE:o}"}
    stated = []
    for page in pages():
        text = prose(page)
        for file_mode, dir_mode in re.findall(r"`(0[0-7]{3})` in `(0[0-7]{3})` folders", text):
            assert (file_mode, dir_mode) == (f"0{FILE_MODE:o}", f"0{DIR_MODE:o}"), page
            stated.append(page)
        # Any other mode in backticks is an old one the text names as such.
        for match in re.finditer(r"`(0[0-7]{3})`", text):
            if match.group(1) not in modes:
                assert text[match.end() : match.end() + 20].startswith(" keep their mode"), (page, match.group(0))
    assert stated, "the manual no longer says which modes stored files get"


# --- Refusal codes --------------------------------------------------------------------------------

# Codes a library answers under its own name (DRF's Throttled and ParseError).
LIBRARY_CODES = {"throttled", "parse_error"}


def test_every_refusal_code_the_manual_names_is_one_the_code_answers():
    """`409 run_waiting`, 409 `run_waiting`: each code is a string the code base answers with. The
    changelog names codes that are gone, on purpose."""
    source = "".join(path.read_text() for folder in CODE_DIRS for path in (ROOT / folder).rglob("*.py"))
    named: set[str] = set()
    for page in pages():
        if page.name == "changelog.md":
            continue
        text = page.read_text()
        named |= {code for _, code in re.findall(r"\b([45]\d\d) `([a-z][a-z_]+)`", text)}
        named |= {code for _, code in re.findall(r"`([45]\d\d) ([a-z][a-z_]+)`", text)}
    assert len(named) > 30
    unknown = sorted(code for code in named - LIBRARY_CODES if f'"{code}"' not in source and f"'{code}'" not in source)
    assert unknown == []


def test_the_api_pages_resume_row_names_every_resume_refusal():
    from runs.refusals import RESUME_REFUSAL_ORDER

    row = next(row for row in table_after((DOCS / "api.md").read_text(), "| method, path |") if "/resume/`" in row[0])
    named = set(re.findall(r"`([a-z_]+)`", row[2]))
    assert {refusal.code for refusal in RESUME_REFUSAL_ORDER} <= named
