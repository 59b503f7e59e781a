"""bench_agents on the tiny model: each side runs on a fresh engine (retention + tier
against plain LRU), every later turn is counted and its cached tokens split into pool and
tier, the integrity checks pass after each round, and parts of a campaign merge."""

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
                          "--num-pages", "24", "--retention-max-pages", "12", "--tier-max-bytes", str(2**22),
                          "--name", "bench_agents_test", "--engine-args", "num_threads=1"])
    on, off = payload["rows"]
    assert (on["side"], off["side"]) == ("retention_tier", "lru")
    assert on["later_turns"] == off["later_turns"] == 2 * 2
    assert on["later_prompt_tokens"] == off["later_prompt_tokens"]  # the same texts on both sides
    assert 0 < on["hit_rate"] <= 1 and on["recomputed_tokens"] >= 0
    assert off["tier_hit_tokens"] == 0 and off["kv_tier_stored_pages"] == 0  # the baseline has no tier
    assert on["kv_tier_stored_pages"] > 0  # a pool of 24 pages cannot hold both agents and the traffic
    for side in payload["rounds"].values():
        assert all(r["integrity"] == "passed" for r in side)
    saved = json.loads((Path(os.environ["ARBOR_BENCH_RESULTS"]) / "bench_agents_test.json").read_text())
    assert saved["targets_met"]["retention_tier"].keys() == {"recomputed >= 2x fewer", "ttft_p50 >= 1.5x lower",
                                                             "throughput not lower"}


def round_of(side: str, recomputed: int, ttft: float, rps: float) -> dict[str, Any]:
    return {"side": side, "wall_s": 10.0, "later_turns": 4, "later_prompt_tokens": 1000,
            "recomputed_tokens": recomputed, "pool_hit_tokens": 1000 - recomputed, "tier_hit_tokens": 0,
            "hit_rate": 1 - recomputed / 1000, "ttft_p50_s": ttft, "ttft_p99_s": ttft, "requests_per_s": rps,
            "tokens_per_s": 100 * rps, "background_requests": 3, "prefill_tokens": recomputed,
            "retention_pins_refused": 0, "kv_tier_stored_pages": 0, "kv_tier_dropped_pages": 0,
            "num_retractions": 0, "integrity": "passed"}


def test_merged_parts_report_their_rounds_together(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bench = load_bench()
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    settings = {"agents": 4, "turns": 5, "tool_sleep": [0.5, 3.0], "result_words": 350, "system_words": 600,
                "background": 1, "background_words": 400, "num_pages": 320, "rounds": 1, "first_round": 0}
    for name, on, off in (("p1", round_of("retention_tier", 100, 1.0, 0.5), round_of("lru", 400, 3.0, 0.4)),
                          ("p2", round_of("retention_tier", 200, 2.0, 0.5), round_of("lru", 400, 2.0, 0.5))):
        part = {"command": f"bench_agents.py --name {name}", "settings": settings,
                "rounds": {"retention_tier": [on], "lru": [off]}}
        (tmp_path / f"{name}.json").write_text(json.dumps(part))
    results, merged_settings, commands = bench.merge(["p1", "p2"])
    payload = bench.report(results, merged_settings)
    on, off = payload["rows"]
    assert (on["rounds"], on["recomputed_tokens"], off["recomputed_tokens"]) == (2, 300, 800)
    assert payload["ratios"]["retention_tier"]["recomputed"] == pytest.approx(800 / 300)
    assert payload["ratios"]["retention_tier"]["ttft_p50"] == pytest.approx(2.5 / 1.5)  # medians of the rounds
    assert payload["targets_met"]["retention_tier"] == {"recomputed >= 2x fewer": True,
                                                        "ttft_p50 >= 1.5x lower": True,
                                                        "throughput not lower": True}
    assert commands == ["bench_agents.py --name p1", "bench_agents.py --name p2"]
    assert "rounds" not in merged_settings and "2 rounds a side" in payload["summary"][0]
