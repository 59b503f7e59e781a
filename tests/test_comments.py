"""Comments and docstrings say why the code is as it is; measured figures live in
benchmarks/results/ and docs/benchmarks.md (generated), where they keep their machine,
date and command. This lint flags speed figures (ms, µs, tok/s, GB/s) in the source's
comments and docstrings outside benchmarks/."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "frontend_dsl", "kernels", "grammars")
FIGURE = re.compile(r"\d(?:[\d,]*)(?:\.\d+)?\s*(?:ms|µs|us|ns|tok/s|tokens/s|GB/s|MB/s)(?![\w/])")


def _prose(path: Path) -> Iterator[tuple[int, str]]:
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def figures_in_comments() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, text in _prose(path):
                found += [f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}" for m in FIGURE.finditer(text)]
    return found


def test_no_speed_figures_in_comments_or_docstrings() -> None:
    assert figures_in_comments() == []


def test_the_lint_sees_a_figure_in_a_comment_and_a_docstring(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('"""Fast: 12.5 ms a step."""\nx = 1  # 93 tok/s here\ny = "10 ms in a string is data"\n')
    assert [m.group(0) for _, text in _prose(sample) for m in FIGURE.finditer(text)] == ["93 tok/s", "12.5 ms"]
