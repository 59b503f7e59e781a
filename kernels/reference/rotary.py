"""Rotary position embedding in plain torch (HF "rotate half" layout): the specification
and the fallback."""

from __future__ import annotations

import torch


def apply_rotary(
    x: torch.Tensor,  # [T, H, D], may be a strided view (q and k heads of a fused qkv row)
    cos: torch.Tensor,  # [T, 1, D/2] fp32
    sin: torch.Tensor,  # [T, 1, D/2] fp32
) -> None:
    """Rotate ``x`` in place: the halves of each head are the pair,
    ``x1' = x1 cos - x2 sin``, ``x2' = x2 cos + x1 sin``, computed in fp32 and rounded to
    ``x``'s dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
