"""Accepting draft tokens exactly as the target model would have produced them.

For a request that decodes token ``x0`` (its newest sampled token) with drafts
``d1..dk``, one forward pass over ``[x0, d1, .., dk]`` gives logits rows ``0..k``; row
``i`` is the model's distribution for the token after ``d_i`` (``d_0 = x0``). Walking the
rows in order, with the grammar mask applied to each from the matcher's state at that
point, the token at each position is chosen exactly as plain decoding chooses it there
(``runtime.sampling.sampler``: the argmax when greedy; Gumbel-max with noise keyed by the
request's seed and the output position when sampling), and ``d_{i+1}`` is accepted iff
it is that token. The first mismatch is replaced by the chosen token.

Penalties and ``min_tokens`` depend on the tokens before a position, drafts included:
row ``i`` is adjusted as if ``d1..di`` (all accepted, or the walk would have stopped)
were already in the output, so verification stays exact for penalized requests too.

So the output is token for token what decoding without drafts gives, greedy or sampled,
and a point-mass draft accepted this way keeps the sampling distribution exactly (the
accepted token is the one the sampler would have drawn). If every draft is accepted,
row ``k`` yields one more token for free.
"""

from __future__ import annotations

import torch

from runtime.constrained.masking import mask_logits
from runtime.constrained.matcher import GrammarMatcher
from runtime.sampling.params import SamplingParams
from runtime.sampling.penalties import TokenHistory, apply_penalties, suppress_stop_ids
from runtime.sampling.sampler import sample


def verify_drafts(
    logits: torch.Tensor,  # [k + 1, V] rows for positions x0, d1, .., dk
    drafts: list[int],  # [k]
    params: SamplingParams,
    matcher: GrammarMatcher | None,
    seed: int,
    position: int,  # output position of the token row 0 chooses
    stop_ids: set[int],  # the ids that end the request (masked before min_tokens)
    history: TokenHistory | None = None,  # the request's token counts, when penalized
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
        if history is not None:
            apply_penalties(row, [params], [history], pending=[out])
        if position + i < params.min_tokens:
            suppress_stop_ids(row, [0], [sorted(stop_ids)])
        token = sample(row, [params], [seed], [position + i]).token_ids[0]
        draft = drafts[i] if i < len(drafts) else None
        out.append(token)
        if matcher is not None:
            matcher.accept_token(token)
        if token != draft or token in stop_ids:
            return out, i + (token == draft)
    return out, len(drafts)
