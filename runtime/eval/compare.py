"""Token-level comparison of two answers to the same request, torch-free.

One implementation for both users: ``arbor eval``'s replay (``replay.py``) and the
router's live shadow replay (``runtime/router/shadow.py``), so a figure the router
exports on live traffic means exactly what the offline eval prints.

    first_divergence   the first position where two token lists differ (None: one is
                       a prefix of the other, or they are equal)
    prefix_share       share of the baseline's tokens before the first difference
    greedy_match       (share identical, mean prefix share) over pairs of outputs
    topk_kl            KL(baseline || candidate) at one position from top-k logprobs
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

# NOTE: a "token" is a token id, or, where an answer carries no ids (the router's shadow
# of OpenAI answers), the token's text or one character: anything that compares by value
K = TypeVar("K", bound=Hashable)


def first_divergence(base: Sequence[Hashable], cand: Sequence[Hashable]) -> int | None:
    """Index of the first differing token; None when equal or one is a prefix of the
    other (a length difference is not a token difference)."""
    return next((i for i, (x, y) in enumerate(zip(base, cand, strict=False)) if x != y), None)


def prefix_share(base: Sequence[Hashable], cand: Sequence[Hashable]) -> float:
    """Share of ``base``'s tokens before the first difference (the shorter length when
    one is a prefix of the other)."""
    div = first_divergence(base, cand)
    n = min(len(base), len(cand)) if div is None else div
    return n / max(len(base), 1)


def greedy_match(pairs: Sequence[tuple[Sequence[Hashable], Sequence[Hashable]]]) -> tuple[float, float]:
    """(share of identical outputs, mean share of tokens before the first difference)
    over (baseline, candidate) token lists."""
    if not pairs:
        return 0.0, 0.0
    same = sum(list(b) == list(c) for b, c in pairs)
    return same / len(pairs), sum(prefix_share(b, c) for b, c in pairs) / len(pairs)


def topk_kl(base_top: Mapping[K, float], cand_top: Mapping[K, float]) -> float:
    """KL(base || cand) in nats at one position from each side's top-k logprobs.

    The sum over the baseline's top-k tokens of p (log p - log q), where a token outside
    the candidate's top-k gets the candidate's smallest listed logprob (an upper bound of
    its own): the mass outside the baseline's top-k is left out. Clamped at 0.
    """
    if not base_top or not cand_top:
        raise ValueError("topk_kl needs the top logprobs of both sides")
    floor = min(cand_top.values())
    kl = 0.0
    for token, log_p in base_top.items():
        kl += math.exp(log_p) * (log_p - cand_top.get(token, floor))
    return max(kl, 0.0)


def mean_topk_kl(base_tops: Sequence[Mapping[K, float]], cand_tops: Sequence[Mapping[K, float]]) -> float:
    """Mean of ``topk_kl`` over positions (the two sequences pair up position by position)."""
    if len(base_tops) != len(cand_tops):
        raise ValueError(f"{len(base_tops)} baseline positions against {len(cand_tops)} candidate positions")
    if not base_tops:
        return 0.0
    return sum(topk_kl(b, c) for b, c in zip(base_tops, cand_tops, strict=True)) / len(base_tops)

