"""docs/benchmarks.md is generated from benchmarks/results/*.json (benchmarks/report.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def load_report() -> Any:
    spec = importlib.util.spec_from_file_location("arbor_report", ROOT / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_page_is_the_saved_results() -> None:
    """Regenerate with ``.venv/bin/python benchmarks/report.py`` after saving a result."""
    assert (ROOT / "docs" / "benchmarks.md").read_text() == load_report().render()


def test_a_result_renders_with_its_command_machine_and_table(tmp_path: Path) -> None:
    result = {"title": "Decode speed", "command": "python benchmarks/x.py --n 3", "date": "2026-12-03",
              "cpu": {"model": "AMD EPYC", "family_model": "25/17", "flags": ["avx2", "avx512_vnni"], "cores": 2},
              "machine": "Linux", "summary": ["ours 2.0x the baseline"],
              "rows": [{"side": "arbor", "tok/s": 100.0}, {"side": "baseline", "tok/s": 50.0}], "extra": 7}
    (tmp_path / "decode.json").write_text(json.dumps(result))
    page = load_report().render(tmp_path)
    assert "## Decode speed" in page and '<a id="decode"></a>' in page
    assert "- command: `python benchmarks/x.py --n 3`" in page
    assert "- machine: AMD EPYC (family/model 25/17; avx2, avx512_vnni), 2 cores" in page
    assert "| side | tok/s |\n|---|---|\n| arbor | 100 |\n| baseline | 50 |" in page
    assert '"extra": 7' in page  # fields without a place of their own are kept, folded
