"""Batched sampling: temperature, top-k, top-p, min-p, per-request seeds, logprobs.

One call handles the whole batch with tensor ops. Randomness is one uniform number per
request per step, drawn from that request's own generator when it has a seed, so a
seeded request draws the same numbers alone or inside any batch. The token is picked by
inverse CDF over the filtered distribution (sorted by probability, ties by token id).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float] | None  # log p of each chosen token (raw model distribution)
    top_logprobs: list[dict[int, float]] | None  # per row, k most likely tokens (k = max asked)


def sample(
    logits: torch.Tensor,  # [B, V] float32 (masked where constrained: -inf = forbidden)
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> SampleOutput:
    batch = logits.shape[0]
    greedy = torch.tensor([p.greedy for p in params])
    token_ids = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        rows = (~greedy).nonzero().flatten()
        sub = [params[i] for i in rows.tolist()]
        gens = [generators[i] or default_generator for i in rows.tolist()]
        token_ids[rows] = _sample_rows(logits[rows], sub, gens)
    ids = token_ids.tolist()
    want_lp = any(p.logprobs or p.top_logprobs for p in params)
    if not want_lp:
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
    generators: list[torch.Generator],
) -> torch.Tensor:  # [N] int64
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32)[:, None]
    probs = torch.softmax(logits / temp, dim=-1)
    u = torch.stack([torch.rand((), generator=g) for g in generators])[:, None]
    if not any(p.top_k or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        # No filter: inverse CDF in token-id order, no sort needed.
        return _inverse_cdf(probs, u)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = _filter_mask(sorted_probs, params)
    return order.gather(1, _inverse_cdf(sorted_probs * keep, u)[:, None]).flatten()


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[N, V] probabilities after temperature, top-k, top-p and min-p (rows sum to 1).

    The same distribution ``_sample_rows`` draws from (used to verify sampled drafts).
    """
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32)[:, None]
    probs = torch.softmax(logits.float() / temp, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = _filter_mask(sorted_probs, params)
    kept = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    return kept / kept.sum(dim=-1, keepdim=True)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [N] int64
    """The first index whose cumulative mass exceeds ``u`` x total, skipping zero-mass tail."""
    cdf = probs.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).flatten()
    # Float round-off can land past the last entry with mass: clamp to it.
    last = (probs > 0).cumsum(dim=-1).argmax(dim=-1)
    return torch.minimum(pick, last)


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
