"""Batched sampling filters and seeds."""

from __future__ import annotations

import torch

from runtime.sampling.sampler import sample
from runtime.sampling_params import SamplingParams


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [sample(logits[None], [params], [None], gen).token_ids[0] for _ in range(n)]


LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04]))


def test_greedy_is_argmax() -> None:
    assert draw(LOGITS, SamplingParams(temperature=0.0), 3) == [0, 0, 0]


def test_top_k_top_p_min_p_restrict_support() -> None:
    assert set(draw(LOGITS, SamplingParams(top_k=2), 300)) == {0, 1}
    assert set(draw(LOGITS, SamplingParams(top_p=0.7), 300)) == {0, 1}  # 0.5 + 0.25 covers 0.7
    assert set(draw(LOGITS, SamplingParams(min_p=0.2), 300)) == {0, 1, 2}  # p >= 0.1


def test_frequencies_follow_the_distribution() -> None:
    counts = torch.bincount(torch.tensor(draw(LOGITS, SamplingParams(), 4000)), minlength=5).float()
    assert torch.allclose(counts / counts.sum(), LOGITS.exp(), atol=0.03)


def test_per_request_generators_are_independent_of_batch() -> None:
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    batched = sample(logits, params, list(gens), torch.Generator()).token_ids
    alone = [sample(logits[i : i + 1], [params[i]], [torch.Generator().manual_seed(s)], torch.Generator()).token_ids[0]
             for i, s in enumerate((1, 2, 3))]
    assert batched == alone


def test_logprobs_and_top_logprobs() -> None:
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    out = sample(LOGITS[None], [params], [None], torch.Generator())
    assert out.logprobs is not None and abs(out.logprobs[0] - float(LOGITS[0])) < 1e-5
    assert out.top_logprobs is not None and list(out.top_logprobs[0]) == [0, 1]
