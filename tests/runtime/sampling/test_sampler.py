"""Batched sampling: filters, the distribution, and tokens that depend on (seed, position)
alone."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from runtime.sampling.params import SamplingParams
from runtime.sampling.sampler import gumbel_noise, noise_key, sample


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """``n`` draws of one row: output positions 0 .. n-1 of a request seeded ``seed``."""
    return [sample(logits[None], [params], [seed], [i]).token_ids[0] for i in range(n)]


def expected(probs: torch.Tensor, n: int) -> list[float]:
    """Expected counts of ``n`` draws, summing to ``n`` exactly (as chisquare wants)."""
    p = probs.double() / probs.double().sum()
    return (p * n).tolist()


LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04]))


def test_greedy_is_argmax() -> None:
    assert draw(LOGITS, SamplingParams(temperature=0.0), 3) == [0, 0, 0]


def test_top_k_top_p_min_p_restrict_support() -> None:
    assert set(draw(LOGITS, SamplingParams(top_k=2), 300)) == {0, 1}
    assert set(draw(LOGITS, SamplingParams(top_p=0.7), 300)) == {0, 1}  # 0.5 + 0.25 covers 0.7
    assert set(draw(LOGITS, SamplingParams(min_p=0.2), 300)) == {0, 1, 2}  # p >= 0.1


def test_frequencies_follow_the_distribution() -> None:
    counts = torch.bincount(torch.tensor(draw(LOGITS, SamplingParams(), 4000)), minlength=5)
    assert chisquare(counts.numpy(), expected(LOGITS.exp(), 4000)).pvalue > 0.001


@pytest.mark.parametrize("params,probs", [
    (SamplingParams(temperature=0.5), torch.softmax(LOGITS / 0.5, dim=-1)),
    (SamplingParams(top_k=3), torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0]) / 0.9),
    (SamplingParams(top_p=0.8), torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0]) / 0.9),
])
def test_temperature_and_filters_keep_their_meaning(params: SamplingParams, probs: torch.Tensor) -> None:
    # The first token of 4,000 requests seeded 0..3999 (the other axis of the noise).
    tokens = [sample(LOGITS[None], [params], [seed], [0]).token_ids[0] for seed in range(4000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=5)
    support = probs > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].numpy(), expected(probs[support], 4000)).pvalue > 0.001


def test_a_token_depends_on_seed_and_position_only() -> None:
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    batched = sample(logits, params, [1, 2, 3], [5, 0, 9]).token_ids
    alone = [sample(logits[i : i + 1], [params[i]], [s], [p]).token_ids[0]
             for i, (s, p) in enumerate(zip((1, 2, 3), (5, 0, 9), strict=True))]
    assert batched == alone
    again = [sample(logits[:1], [params[0]], [1], [5]).token_ids[0] for _ in range(5)]
    assert again == [batched[0]] * 5  # no hidden state advances between calls


def test_masked_tokens_are_never_drawn() -> None:
    logits = LOGITS.clone()
    logits[0] = float("-inf")  # a grammar forbids the likeliest token
    assert 0 not in draw(logits, SamplingParams(), 500)


def test_noise_streams_are_unrelated() -> None:
    keys = {noise_key(s, p) for s in range(50) for p in range(50)}
    assert len(keys) == 2500  # no two (seed, position) pairs share a stream
    a, b = gumbel_noise(1, 0, 1000), gumbel_noise(1, 1, 1000)
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.1
    assert torch.equal(a, gumbel_noise(1, 0, 1000))


def test_logprobs_and_top_logprobs() -> None:
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    out = sample(LOGITS[None], [params], [0], [0])
    assert out.logprobs is not None and abs(out.logprobs[0] - float(LOGITS[0])) < 1e-5
    assert out.top_logprobs is not None and list(out.top_logprobs[0]) == [0, 1]
