"""``arbor eval`` end to end on the tiny random Llama: engine settings on both sides, two
servers, the JSON report, the exit status of a failing gate, and refused arguments."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime import Engine
from runtime.cli import main

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_helpers import LiveServer  # noqa: E402

TINY = {"num_pages": 512, "max_model_len": 512, "num_threads": 1, "freeze_gc": False}


def _common() -> str:
    return ",".join(f"{k}={v}" for k, v in TINY.items())


@pytest.mark.slow
def test_eval_compares_two_engine_settings_and_writes_the_report(
        tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "report.json"
    status = main(["eval", "--model", str(tiny_llama_dir), "--common", _common(),
                   "--baseline", "kv_cache_dtype=auto", "--candidate", "kv_cache_dtype=int8",
                   "--limit", "2", "--json", str(path), "--min-valid", "0", "--max-kl", "10",
                   "--speed-repeats", "2"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "kv_cache_dtype=auto" in out and "kv_cache_dtype=int8" in out and "next-token top-1" in out
    report = json.loads(path.read_text())
    assert report["passed"] is True
    assert report["baseline_settings"]["kv_cache_dtype"] == "auto"
    assert report["candidate_settings"]["kv_cache_dtype"] == "int8"
    cmp = report["comparison"]
    assert cmp["kl_method"] == "exact" and cmp["num_positions"] > 20 and 0 <= cmp["top1_agreement"] <= 1
    assert cmp["mean_kl"] >= 0
    for side in ("baseline_scores", "candidate_scores"):
        scores = report[side]
        # a random model's JSON may run past max_new_tokens: valid, unless cut off
        assert scores["constrained_valid"] in (0.0, 0.5, 1.0)
        assert scores["perplexity"] > 1 and scores["batch_tok_s"] > 0
    assert [g["name"] for g in report["gates"]] == ["max_kl", "min_valid"]


def test_identical_settings_agree_fully_and_a_failing_gate_exits_1(
        tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["eval", "--model", str(tiny_llama_dir), "--common", _common(), "--limit", "1", "--speed-repeats", "1",
                   "--min-agreement", "1.0", "--max-kl", "1e-9", "--min-greedy-match", "1.0",
                   "--max-ppl-ratio", "0.5"])
    out = capsys.readouterr().out
    assert status == 1
    assert "gate min_agreement 1: 1 PASS" in out and "gate max_kl 1e-09: 0 PASS" in out
    assert "gate min_greedy_match 1: 1 PASS" in out and "gate max_ppl_ratio 0.5: 1 FAIL" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--candidate", "kv_cache_dtype=int3"], "kv_cache_dtype must be one of"),
    (["--baseline", "nonsense=1"], "unknown engine setting 'nonsense'"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--speed-repeats", "0"], "--speed-repeats must be >= 1"),
    (["--json", "/no/such/dir/r.json"], "--json: no directory"),
])
def test_bad_arguments_exit_2_before_loading_anything(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--model", "nowhere", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir: Path) -> Iterator[Any]:
    from runtime.server import create_app

    engine = Engine(model=str(tiny_llama_dir), **TINY)
    with LiveServer(create_app(engine)) as live:
        yield live
    engine.close()


def test_eval_against_two_servers_uses_top_k_distributions(
        tiny_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same server on both sides: every measure agrees exactly, through HTTP."""
    path = tmp_path / "report.json"
    status = main(["eval", "--baseline-url", tiny_server.url, "--candidate-url", tiny_server.url,
                   "--limit", "1", "--json", str(path), "--min-agreement", "1.0", "--max-kl", "1e-6",
                   "--speed-repeats", "1"])
    assert status == 0, capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["comparison"]["kl_method"] == "top-20"
    assert report["comparison"]["greedy_match"] == 1.0
    assert report["baseline_scores"]["perplexity"] == pytest.approx(report["candidate_scores"]["perplexity"])


def test_engine_score_gives_the_logits_serving_computes(tiny_llama_dir: Path) -> None:
    import torch

    from runtime import SamplingParams

    for kv in ("auto", "int8"):
        engine = Engine(model=str(tiny_llama_dir), kv_cache_dtype=kv, **TINY)
        try:
            ids = list(range(300, 340))
            out = engine.generate(input_ids=ids, sampling_params=SamplingParams(
                max_new_tokens=4, temperature=0.0, prompt_logprobs=True))[0]
            logp = torch.log_softmax(engine.score(ids + out.token_ids), -1)
            assert logp[len(ids) - 1:-1].argmax(-1).tolist() == out.token_ids
            expected = torch.tensor(out.prompt_logprobs[1:])
            torch.testing.assert_close(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], expected,
                                       atol=1e-4, rtol=0)
        finally:
            engine.close()
