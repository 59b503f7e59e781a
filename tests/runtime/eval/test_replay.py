"""The eval's measures on hand-made distributions and outputs, and its gates."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.errors import InvalidRequestError
from runtime.eval.replay import greedy_match, mean_kl
from runtime.eval.report import Comparison, TargetScores, check_gates, measures
from runtime.eval.targets import Generation, PositionDists, parse_settings


def _dists(logits: torch.Tensor, k: int, full: bool) -> PositionDists:
    logp = torch.log_softmax(logits, -1)
    top = logp.topk(k, -1)
    return PositionDists(top.indices, top.values, logp if full else None)


def test_kl_is_exact_with_whole_distributions_and_bounded_with_top_k() -> None:
    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(6, 50, generator=gen) * 3, torch.randn(6, 50, generator=gen) * 3
    exact = torch.nn.functional.kl_div(torch.log_softmax(q, -1), torch.log_softmax(p, -1),
                                       log_target=True, reduction="none").sum(-1).mean()
    kl, method = mean_kl(_dists(p, 20, True), _dists(q, 20, True))
    assert method == "exact" and kl == pytest.approx(float(exact), rel=1e-5)
    same, _ = mean_kl(_dists(p, 20, True), _dists(p, 20, True))
    assert same == pytest.approx(0.0, abs=1e-6)
    truncated, method = mean_kl(_dists(p, 50, False), _dists(q, 50, False))  # k = vocab: exact again
    assert method == "top-50" and truncated == pytest.approx(float(exact), rel=1e-4)
    partial, method = mean_kl(_dists(p, 5, False), _dists(q, 5, False))
    assert method == "top-5" and math.isfinite(partial) and partial >= 0


def test_greedy_match_counts_identical_outputs_and_the_common_prefix() -> None:
    base = [Generation([1, 2, 3, 4], ""), Generation([5, 6, 7, 8], "")]
    cand = [Generation([1, 2, 3, 4], ""), Generation([5, 6, 0, 0], "")]
    assert greedy_match(base, cand) == (0.5, 0.75)


def test_gates_pass_and_fail_on_their_side_of_the_bound() -> None:
    base = TargetScores(10.0, 0.8, 1.0, 0.5, 20.0, 100.0)
    cand = TargetScores(10.5, 0.7, 0.9, 0.5, 30.0, 150.0)
    values = measures(base, cand, Comparison(0.96, 0.02, "exact", 100, 0.5, 0.8))
    assert values["ppl_ratio"] == pytest.approx(1.05) and values["exact_drop"] == pytest.approx(0.1)
    gates = {g.name: g.passed for g in check_gates(
        {"min_agreement": 0.97, "max_kl": 0.05, "max_ppl_ratio": 1.1, "max_exact_drop": 0.05,
         "min_valid": 0.9, "min_greedy_match": 0.6}, values)}
    assert gates == {"min_agreement": False, "max_kl": True, "max_ppl_ratio": True,
                     "max_exact_drop": False, "min_valid": True, "min_greedy_match": False}


def test_settings_parse_typed_by_the_engine_config() -> None:
    assert parse_settings("kv_cache_dtype=int8, page_size=16,mem_fraction=0.2,speculation=false") == {
        "kv_cache_dtype": "int8", "page_size": 16, "mem_fraction": 0.2, "speculation": False}
    assert parse_settings("max_model_len=none") == {"max_model_len": None}
    assert parse_settings("") == {}
    with pytest.raises(InvalidRequestError, match="unknown engine setting 'kv_dtype'"):
        parse_settings("kv_dtype=int8")
    with pytest.raises(InvalidRequestError, match="page_size takes a value of type int"):
        parse_settings("page_size=big")
    with pytest.raises(InvalidRequestError, match="key=value"):
        parse_settings("int8")
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of"):
        parse_settings("kv_cache_dtype=int3")
