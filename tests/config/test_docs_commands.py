"""The commands the manual prints run as printed.

A page marks a block the way a reader would use it: `<!-- docs-test: file PATH -->` before a
block a reader saves as PATH, `<!-- docs-test: run [worker] [exit=N] -->` before a shell block
that runs offline (with `worker`: while the app's worker runs, as after `make run`). Each marked
block runs with bash, from a fresh copy of the project on its own SQLite database and the scripted
model, in an environment that holds none of the settings' variables: what it needs, it says on
its own line (`DEBUG=true`, `AGENTS_DIR=…`). It must exit as the page says (0 unless `exit=N`)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.config.test_docs_pages import READ_ELSEWHERE, pages
from tests.config.test_docs_truth import settings_variables

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MARKED = re.compile(r"^<!-- docs-test: (file|run)\b([^>]*?)\s*-->\n```[\w-]*\n(.*?)^```", re.M | re.S)
PROJECT = ("config", "agents", "memory", "runs", "templates", "manage.py", "Makefile", "requirements.txt", "pyproject.toml")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    kind: str  # "file" or "run"
    options: tuple[str, ...]
    text: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def exit_code(self) -> int:
        return next((int(option.split("=", 1)[1]) for option in self.options if option.startswith("exit=")), 0)

    @property
    def path(self) -> str:
        return self.options[0]


def marked_blocks() -> list[Block]:
    blocks = []
    for page in pages():
        text = page.read_text()
        for match in MARKED.finditer(text):
            blocks.append(
                Block(
                    page=page.relative_to(ROOT).as_posix(),
                    line=text.count("\n", 0, match.start()) + 1,
                    kind=match.group(1),
                    options=tuple(match.group(2).split()),
                    text=match.group(3),
                )
            )
    return blocks


BLOCKS = marked_blocks()
RUN_BLOCKS = [block for block in BLOCKS if block.kind == "run"]
FILE_BLOCKS = [block for block in BLOCKS if block.kind == "file"]


def bare_environment() -> dict[str, str]:
    """This process's environment without any variable the project reads: a reader's fresh shell."""
    drop = settings_variables() | set(READ_ELSEWHERE) | {"DJANGO_SETTINGS_MODULE", "GOOGLE_API_KEY", "AGENT_MODEL"}
    return {name: value for name, value in os.environ.items() if name not in drop and not name.startswith("PYTEST_")}


def manage(copy: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [".venv/bin/python", "manage.py", *args],
        cwd=copy,
        env={**bare_environment(), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A fresh copy of the project, migrated as `make run` migrates it, with the marked files
    saved and, for the blocks that need one, a worker running as `make run` runs it."""
    copy = tmp_path_factory.mktemp("project")
    for name in PROJECT:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, copy / name)
    (copy / ".venv").symlink_to((ROOT / ".venv").resolve())
    for block in FILE_BLOCKS:
        target = copy / block.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text)
    migrated = manage(copy, "migrate", "--noinput", DEBUG="true")
    assert migrated.returncode == 0, migrated.stderr[-2000:]
    # The worker `make run` starts, with the agent folders the marked files add (as the page's
    # `AGENTS_DIR=… make run` does).
    folders = ["agents/bundled", *sorted({Path(block.path).parts[0] for block in FILE_BLOCKS if len(Path(block.path).parts) > 2})]
    worker = None
    if any("worker" in block.options for block in RUN_BLOCKS):
        worker = subprocess.Popen(
            [".venv/bin/python", "manage.py", "runworker", "--processes", "1"],
            cwd=copy,
            env={**bare_environment(), "DEBUG": "true", "AGENTS_DIR": ",".join(folders)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        yield copy
    finally:
        if worker is not None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()


def test_the_manual_marks_its_offline_commands():
    marked = {block.page for block in RUN_BLOCKS}
    assert {"README.md", "docs/recovery.md"} <= marked
    assert [block.path for block in FILE_BLOCKS] == ["my_agents/orders/agent.py"]


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda block: block.id)
def test_a_marked_command_block_runs_as_printed(project, block):
    started = time.monotonic()
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.text],
        cwd=project,
        env=bare_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == block.exit_code, (
        f"{block.id} exited {result.returncode} after {time.monotonic() - started:.0f} s\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
