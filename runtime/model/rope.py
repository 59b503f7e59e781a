"""Rotary position embeddings (HF "rotate half" layout), with Llama 3 frequency scaling
(HF's settings, or llama.cpp's per-frequency factors)."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:  # [head_dim // 2]
    """Inverse frequencies for ``rope`` settings (``rope_theta``, ``rope_type`` ...)."""
    theta = float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    elif kind == "linear":
        inv_freq = inv_freq / float(rope["factor"])
    elif kind == "freq_factors":  # llama.cpp's rope_freqs.weight: a divisor per frequency
        factors = torch.tensor(rope["freq_factors"], dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"{factors.numel()} rope frequency factors for {inv_freq.numel()} frequencies")
        inv_freq = inv_freq / factors
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope_type {kind!r}")
    return inv_freq.float()


def _llama3_scale(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    factor = float(rope["factor"])
    low = float(rope.get("low_freq_factor", 1.0))
    high = float(rope.get("high_freq_factor", 4.0))
    old_len = float(rope.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(mid, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin table for positions ``0 .. max_positions-1``, looked up by position index
    (``lookup``) and applied with ``kernels.apply_rotary``."""

    def __init__(self, head_dim: int, max_positions: int, rope: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D/2] for token positions [T]: once per forward pass."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
