"""bench_agents on the tiny model: both sides run on one engine, every later turn is
counted, the integrity checks pass after each round, and the result is saved."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_agents.py"


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("arbor_bench_agents", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_bench_agents_runs_both_sides_and_saves(tiny_llama_dir: Path) -> None:
    bench = load_bench()
    payload = bench.main(["--model", str(tiny_llama_dir), "--agents", "2", "--turns", "3", "--rounds", "1",
                          "--system-words", "40", "--result-words", "20", "--call-tokens", "4",
                          "--background", "1", "--background-words", "40", "--tool-sleep", "0.05", "0.1",
                          "--num-pages", "64", "--retention-max-pages", "24", "--name", "bench_agents_test",
                          "--engine-args", "num_threads=1"])
    on, off = payload["rows"]
    assert (on["side"], off["side"]) == ("retention", "lru")
    assert on["later_turns"] == off["later_turns"] == 2 * 2
    assert on["later_prompt_tokens"] == off["later_prompt_tokens"]  # the same texts on both sides
    assert 0 < on["hit_rate"] <= 1 and on["recomputed_tokens"] >= 0
    saved = json.loads((Path(os.environ["ARBOR_BENCH_RESULTS"]) / "bench_agents_test.json").read_text())
    assert saved["targets_met"].keys() == {"recomputed >= 2x fewer", "ttft_p50 >= 1.5x lower",
                                           "throughput not lower"}
