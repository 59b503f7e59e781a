"""Batched sampling: temperature, top-k, top-p, min-p, seeds, logprobs.

A sampled token is a function of the logits and of (seed, position) alone: Gumbel-max.
The token at output position ``i`` of a request with seed ``s`` is::

    argmax_t  logits[t] / T + G(s, i)[t]      over the tokens top-k/top-p/min-p keep

where ``G(s, i)`` is a vector of standard Gumbel noise drawn from a generator seeded by a
hash of ``(s, i)``. That is an exact draw from the filtered softmax (Gumbel-max), and it
uses no random state shared with anything else: a seeded request gives the same tokens
alone or in any batch, under page pressure or retraction, with speculation on or off (a
draft is accepted exactly when it equals this token: ``runtime.speculative.verify``).
Requests without a seed get one from the engine's generator when they are submitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.sampling.params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float] | None  # log p of each chosen token (raw model distribution)
    top_logprobs: list[dict[int, float]] | None  # per row, k most likely tokens (k = max asked)


def sample(
    logits: torch.Tensor,  # [B, V] float32 (masked where constrained: -inf = forbidden)
    params: Sequence[SamplingParams],
    seeds: Sequence[int],  # [B] each row's request seed
    positions: Sequence[int],  # [B] each row's output position (tokens generated before it)
) -> SampleOutput:
    batch = logits.shape[0]
    greedy = torch.tensor([p.greedy for p in params])
    token_ids = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        rows = (~greedy).nonzero().flatten().tolist()
        token_ids[rows] = _sample_rows(logits[rows], [params[i] for i in rows],
                                       [seeds[i] for i in rows], [positions[i] for i in rows])
    ids = token_ids.tolist()
    if not any(p.logprobs or p.top_logprobs for p in params):
        return SampleOutput(ids, None, None)
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp[torch.arange(batch), token_ids].tolist()
    k = max(p.top_logprobs for p in params)
    top = None
    if k:
        vals, idx = logp.topk(k, dim=-1)
        top = [dict(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
    return SampleOutput(ids, chosen, top)


def _sample_rows(
    logits: torch.Tensor,  # [N, V]
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
) -> torch.Tensor:  # [N] int64
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32)[:, None]
    scaled = logits.float() / temp
    if any(p.top_k or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, _filter_mask(sorted_probs, params))
        scaled = scaled.masked_fill(~keep, float("-inf"))
    noise = torch.stack([gumbel_noise(s, i, logits.shape[1]) for s, i in zip(seeds, positions, strict=True)])
    return (scaled + noise).argmax(dim=-1)


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """[V] standard Gumbel noise, a pure function of (seed, position)."""
    gen = torch.Generator().manual_seed(noise_key(seed, position))
    u = torch.rand(vocab_size, generator=gen)  # [0, 1): u = 0 gives -inf (never picked)
    return -torch.log(-torch.log(u))


def noise_key(seed: int, position: int) -> int:
    """A 64-bit generator seed for (seed, position): splitmix64 of the pair, so nearby
    seeds and positions give unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _filter_mask(sorted_probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[N, V] bool over probabilities sorted descending: which survive top-k/top-p/min-p."""
    num_rows, vocab = sorted_probs.shape
    rank = torch.arange(vocab)[None, :]
    top_k = torch.tensor([p.top_k or vocab for p in params])[:, None]
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)[:, None]
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)[:, None]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < top_k) & (mass_before < top_p) & (sorted_probs >= min_p * sorted_probs[:, :1])
    keep[:, 0] = True  # the most likely token always survives
    return keep
