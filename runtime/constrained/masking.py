"""Constrained decoding inside the engine step: one batched mask, then token acceptance.

Each constrained request carries a ``GrammarMatcher``. Per step, every constrained row's
matcher writes its allowed-token bits into one bitmask, and one vectorised call masks
all those logits rows before sampling; unconstrained rows are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.constrained.bitmask import allocate_token_bitmask, apply_token_bitmask
from runtime.constrained.matcher import GrammarMatcher


def mask_logits(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> list[int]:
    """Mask ``logits`` [B, V] in place by each row's matcher (None = unconstrained).

    Returns:
        The rows whose grammar allows no token at all (a dead end the caller must end).
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return []
    bitmask = allocate_token_bitmask(logits.shape[0], logits.shape[1])  # all allowed
    for i in rows:
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill_bitmask(bitmask, i)
    _apply(logits, bitmask, rows)
    dead = (bitmask[rows] == 0).all(dim=-1)
    return [rows[j] for j in dead.nonzero().flatten().tolist()]


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Mask in place; unconstrained rows have all bits set, so masking every row is exact.

    NOTE: llguidance's in-place kernel, because unpacking bits with torch ops costs an
    order of magnitude more on the CPU (docs/benchmarks.md#bitmask_apply).
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        import llguidance.torch

        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
    else:
        apply_token_bitmask(logits, bitmask, rows)
