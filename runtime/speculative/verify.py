"""Accepting draft tokens exactly as the target model would have produced them.

For a request that decodes token ``x0`` (its newest sampled token) with drafts
``d1..dk``, one forward pass over ``[x0, d1, .., dk]`` gives logits rows ``0..k``; row
``i`` is the model's distribution for the token after ``d_i`` (``d_0 = x0``). Walking the
rows in order, with the grammar mask applied to each from the matcher's state at that
point:

- greedy: accept ``d_{i+1}`` iff it is the argmax of row ``i``; the first mismatch is
  replaced by the argmax, so the output is token for token what plain decoding gives;
- sampling (the draft is a point mass ``q``): accept ``d_{i+1}`` with probability
  ``p(d_{i+1})``; on rejection sample from ``p`` with ``d_{i+1}`` removed,
  renormalised (the residual ``max(p - q, 0)``), which keeps the output distribution
  exactly ``p`` (Leviathan et al., Chen et al. 2023).

If every draft is accepted, row ``k`` yields one more token for free.
"""

from __future__ import annotations

import torch

from runtime.constrained.masking import mask_logits
from runtime.constrained.matcher import GrammarMatcher
from runtime.sampling.sampler import filtered_probs, sample
from runtime.sampling_params import SamplingParams


def verify_drafts(
    logits: torch.Tensor,  # [k + 1, V] rows for positions x0, d1, .., dk
    drafts: list[int],  # [k]
    params: SamplingParams,
    matcher: GrammarMatcher | None,
    generator: torch.Generator,
    stop_ids: set[int],
) -> tuple[list[int], int]:
    """Returns (tokens to append, number of drafts accepted).

    The matcher (if any) is advanced past every returned token. Tokens after a stop
    token are never returned (the stop token itself is, so the caller can finish).
    """
    out: list[int] = []
    for i in range(len(drafts) + 1):
        row = logits[i : i + 1]
        if matcher is not None and mask_logits(row, [matcher]):
            return out, i  # dead end: no token allowed; the caller finishes the request
        draft = drafts[i] if i < len(drafts) else None
        token = _accept_or_resample(row[0], draft, params, generator)
        out.append(token)
        if matcher is not None:
            matcher.accept_token(token)
        if token != draft or token in stop_ids:
            return out, i + (token == draft)
    return out, len(drafts)


def _accept_or_resample(
    row: torch.Tensor, draft: int | None, params: SamplingParams, generator: torch.Generator
) -> int:
    if params.greedy:
        return int(row.argmax())
    if draft is None:
        return sample(row[None], [params], [generator], generator).token_ids[0]
    probs = filtered_probs(row[None], [params])[0]
    if torch.rand((), generator=generator) < probs[draft]:
        return draft
    residual = probs.clone()
    residual[draft] = 0.0
    if residual.sum() <= 0:
        return draft  # p is a point mass on the draft: it was certain anyway
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
