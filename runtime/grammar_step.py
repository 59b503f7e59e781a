"""Constrained decoding inside the engine step: one batched mask, then token acceptance.

Each constrained request carries a ``GrammarMatcher``. Per step, every constrained row's
matcher writes its allowed-token bits into one bitmask, and one vectorised call masks
all those logits rows before sampling; unconstrained rows are untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.constrained import allocate_token_bitmask, apply_token_bitmask


def mask_logits(logits: torch.Tensor, matchers: list[Any]) -> list[int]:
    """Mask ``logits`` [B, V] in place by each row's matcher (None = unconstrained).

    Returns:
        The rows whose grammar allows no token at all (a dead end the caller must end).
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return []
    bitmask = allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for i in rows:
        matchers[i].fill_bitmask(bitmask, i)
    apply_token_bitmask(logits, bitmask, rows)
    dead = torch.isneginf(logits[rows]).all(dim=-1)
    return [rows[j] for j in dead.nonzero().flatten().tolist()]
