"""Every code block of README.md and docs/ runs, so the docs cannot rot.

Shell blocks: each command is checked where it cannot run here (an ``arbor`` command line
is parsed by the real parser, a ``make`` target must exist, a script must exist) and
``curl`` commands run against a live server. Python blocks run: the blocks of one page
make one script (later blocks may use earlier ones), run in a subprocess against the
default model, with ``localhost:30000`` pointed at a live server. A block preceded by
``<!-- doc-test: skip (reason) -->`` is left out; the reason must name what this machine
lacks (a GPU, a second machine).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"cli.md", "benchmarks.md"}  # generated from code; their own tests keep them true
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED)]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"<!-- doc-test: skip \((.+?)\) -->\s*$")
SERVED_AT = ("localhost:30000", "127.0.0.1:30000")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if SKIP.search(before):
            continue
        found.append(Block(page, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2)))
    return found


def shell_commands(block: Block) -> Iterator[list[str]]:
    """Each command of a shell block as argv (continuations joined, comments dropped)."""
    for line in block.code.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            yield argv


def _all(lang: tuple[str, ...]) -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang in lang]


SHELL = _all(("bash", "sh", "shell"))
PYTHON_PAGES = sorted({b.page for b in _all(("python",))})


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))


def _check_command(argv: list[str]) -> str | None:
    """Why ``argv`` would fail here, or None. curl lines are run by the slow test."""
    from runtime.cli import build_parser

    program = argv[0].removeprefix(".venv/bin/")
    if program == "make":
        missing = [t for t in argv[1:] if t not in _make_targets()]
        return f"no make target {missing}" if missing else None
    if program == "arbor":
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            return None if exc.code == 0 else f"arbor rejects {argv[1:]}"
        return None
    if program == "python":
        if argv[1] == "-m":
            return None if argv[2] in ("pytest", "pip") or _module_exists(argv[2]) else f"no module {argv[2]}"
        return None if (ROOT / argv[1]).exists() else f"no file {argv[1]}"
    if program in ("curl", "pip", "cmake"):
        return None
    if "/" in program and not program.startswith("/"):  # a script of this repository
        return None if (ROOT / program).is_file() else f"no file {program}"
    return f"the doc test does not know how to check {program!r}: teach tests/test_docs.py"


def _module_exists(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_shell_commands_are_real(block: Block) -> None:
    problems = [f"{' '.join(argv)}: {why}" for argv in shell_commands(block) if (why := _check_command(argv))]
    assert problems == [], block.where


def test_the_pages_have_code_and_every_block_a_known_language() -> None:
    """python and shell blocks run or are checked; text and json blocks are diagrams and
    data; a block of any other language would escape the checks."""
    assert SHELL and PYTHON_PAGES
    unknown = [b.where for page in PAGES for b in blocks(page)
               if b.lang not in ("python", "bash", "sh", "shell", "text", "json")]
    assert unknown == []


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    """``arbor serve --model default --programs examples/programs.py``, in process."""
    sys.path.insert(0, str(ROOT / "tests" / "runtime" / "server"))
    from server_helpers import LiveServer

    from runtime import Engine
    from runtime.server import create_app
    from runtime.server.hosting import load_programs

    engine = Engine(model="default", num_pages=4096)
    app = create_app(engine, programs=load_programs(ROOT / "examples" / "programs.py"))
    with LiveServer(app) as live:
        yield live.url.removeprefix("http://")
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page: Path, live_url: str, tmp_path: Path) -> None:
    script = "\n\n".join(b.code for b in blocks(page) if b.lang == "python")
    for address in SERVED_AT:
        script = script.replace(address, live_url)
    path = tmp_path / "page.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"{page.name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.slow
def test_curl_commands_run(live_url: str) -> None:
    commands = [argv for b in SHELL for argv in shell_commands(b) if argv[0] == "curl"]
    assert commands
    for argv in commands:
        for address in SERVED_AT:
            argv = [a.replace(address, live_url) for a in argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (argv, done.stderr)
        body = json.loads(done.stdout)
        assert "error" not in body, (argv, body)
