"""Rotary position embeddings (HF "rotate half" layout) and their long-context variants:
Llama 3 frequency scaling (HF's settings, or llama.cpp's per-frequency factors), linear,
YaRN (Qwen 2.5 / 3 long context), LongRoPE (Phi-3 / 3.5 128k) and dynamic NTK (within
the model's context), as transformers' ``modeling_rope_utils`` defines them."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, rope: dict[str, Any], max_positions: int | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] for ``rope`` settings (``rope_theta``,
    ``rope_type`` ...); ``max_positions``: the longest sequence the tables serve (LongRoPE
    picks its long factors when that exceeds ``original_max_position_embeddings``, as
    llama.cpp does; None: the short ones)."""
    theta = float(rope.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = rope_type(rope)
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    elif kind == "linear":
        inv_freq = inv_freq / float(rope["factor"])
    elif kind == "freq_factors":  # llama.cpp's rope_freqs.weight: a divisor per frequency
        inv_freq = inv_freq / _factors(rope["freq_factors"], inv_freq)
    elif kind == "yarn":
        inv_freq = _yarn_scale(theta, head_dim, rope)
    elif kind == "longrope":
        long = max_positions is not None and max_positions > int(rope["original_max_position_embeddings"])
        inv_freq = inv_freq / _factors(rope["long_factor" if long else "short_factor"], inv_freq)
    elif kind not in ("default", "dynamic", None):  # NOTE: dynamic within its context is the plain rope
        raise ValueError(f"unsupported rope_type {kind!r}")
    return inv_freq.float()


def rope_context_problem(rope: dict[str, Any], max_positions: int) -> str | None:
    """Why tables for ``max_positions`` positions would not be ``rope``'s, if they would not.

    Dynamic NTK scaling changes nothing up to ``max_position_embeddings``; past it,
    transformers recomputes the base from the current length at every forward pass, so a
    cached key's rotation depends on how long its sequence was when it was computed
    (which neither a shared prefix cache nor a batch of requests of other lengths can
    honour). We serve it within that context only."""
    limit = rope.get("max_position_embeddings")
    if rope_type(rope) == "dynamic" and limit is not None and max_positions > int(limit):
        return (f"rope_type 'dynamic' (NTK scaling by the current length) is only served up to the model's "
                f"max_position_embeddings ({int(limit)} tokens), not {max_positions}: lower max_model_len")
    return None


def rope_type(rope: dict[str, Any]) -> str:
    return str(rope.get("rope_type", rope.get("type", "default")))


def rope_attention_factor(rope: dict[str, Any]) -> float:
    """What cos and sin are multiplied by (YaRN's and LongRoPE's attention scaling; 1 else)."""
    kind = rope_type(rope)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = int(rope["original_max_position_embeddings"])
    factor = _factor(rope)
    if kind == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def _factor(rope: dict[str, Any]) -> float:
    """The context extension: ``factor``, else max / original positions (Phi-3, DeepSeek)."""
    if rope.get("factor") is not None:
        return float(rope["factor"])
    return int(rope["max_position_embeddings"]) / int(rope["original_max_position_embeddings"])


def _factors(values: Any, inv_freq: torch.Tensor) -> torch.Tensor:
    factors = torch.tensor(values, dtype=torch.float64).reshape(-1)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"{factors.numel()} rope frequency factors for {inv_freq.numel()} frequencies")
    return factors


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_scale(theta: float, dim: int, rope: dict[str, Any]) -> torch.Tensor:
    """YaRN: high frequencies kept (extrapolated), low ones divided by ``factor``
    (interpolated), a linear ramp between the dims that turn ``beta_fast`` and
    ``beta_slow`` times over the original context. NOTE: float32 throughout, as HF's."""
    factor, original = _factor(rope), int(rope["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dim that turns ``rotations`` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


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
        # NOTE: always real CPU tables, also inside a meta-device model build: there these
        # ops would run torch's reference implementations, which import torch._dynamo and
        # Triton (docs/memory.md); the module's .to(device) moves them.
        if (problem := rope_context_problem(rope, max_positions)) is not None:
            raise ValueError(problem)
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, rope, max_positions)
            t = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # [P, D/2]
            scale = rope_attention_factor(rope)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos() * scale if scale != 1.0 else freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin() * scale if scale != 1.0 else freqs.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D/2] for token positions [T]: once per forward pass."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
