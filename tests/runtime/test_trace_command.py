"""``arbor trace FILE``: runs one program and writes its trace, OTLP spans and timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.cli import main

PROGRAMS = Path(__file__).resolve().parent / "server" / "programs_fixture.py"


def test_arbor_trace_writes_json_otlp_and_svg(tiny_llama_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["trace", str(PROGRAMS), "--program", "two_steps", "--args", '{"topic": "tea"}',
                 "--model", str(tiny_llama_dir), "--num-threads", "1", "--out", str(tmp_path)])
    assert code == 0
    trace = json.loads((tmp_path / "two_steps.trace.json").read_text())
    assert trace["program"] == "two_steps" and trace["status"] == "ok"
    assert [n["name"] for n in trace["nodes"] if n["kind"] == "gen"] == ["first", "second"]
    spans = json.loads((tmp_path / "two_steps.otlp.json").read_text())["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert spans[0]["name"] == "program two_steps" and len(spans) == 1 + len(trace["nodes"])
    assert (tmp_path / "two_steps.svg").read_text().startswith("<svg")
    assert "two_steps: ok" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    ([], "has 4 programs"),
    (["--program", "nope"], "has no program 'nope'"),
    (["--program", "qa", "--args", "[1]"], "--args must be a JSON object"),
    (["--program", "qa", "--args", "{"], "--args is not JSON"),
    (["--program", "qa", "--args", '{"question": 3}'], "arguments of qa: question"),
])
def test_arbor_trace_refuses_bad_input_before_loading_a_model(
        argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", str(PROGRAMS), "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
