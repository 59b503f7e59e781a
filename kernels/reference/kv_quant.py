"""Quantized KV cache: the specification of how K/V rows are stored in 8 bits.

Every (token, KV head) row of ``head_dim`` values is stored as 8-bit codes with one fp32
scale beside it (per token, per head; K and V each)::

    scale = max(|x|) / QMAX          (1.0 for an all-zero row)
    int8:  code = clamp(round(x / scale), -127, 127)       QMAX = 127
    fp8:   code = float8_e4m3fn(x / scale)                   QMAX = 448 (e4m3's largest)
    x ~= code * scale                                        (``dequantize_kv``)

Per-row scales follow each row's own range (outlier heads and tokens do not crush the
others), cost 4 bytes per 64-128 codes, and need no calibration. Every kernel that writes
or reads a quantized pool (C, Triton) implements exactly this.
"""

from __future__ import annotations

import torch

# The 8-bit KV dtypes and the largest code magnitude each one uses.
KV_QUANT_QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether a pool of ``dtype`` stores codes plus scales (int8 / fp8 e4m3)."""
    return dtype in KV_QUANT_QMAX


def quantize_kv(
    x: torch.Tensor,  # [T, Hkv, D] float
    dtype: torch.dtype,  # torch.int8 or torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:  # codes [T, Hkv, D] dtype, scales [T, Hkv] fp32
    """Codes and per-(token, head) scales of ``x`` (see the module docstring)."""
    qmax = KV_QUANT_QMAX[dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    scaled = x / scale[..., None]
    if dtype == torch.int8:
        return scaled.round_().clamp_(-qmax, qmax).to(torch.int8), scale
    return scaled.clamp_(-qmax, qmax).to(dtype), scale


def dequantize_kv(
    codes: torch.Tensor,  # [..., D] int8 / float8_e4m3fn
    scale: torch.Tensor,  # [...] fp32
) -> torch.Tensor:  # [..., D] fp32
    return codes.float() * scale[..., None]


def as_bytes(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` viewed as uint8 (same memory): torch's CPU index ops (index_copy_,
    index_select) do not take float8 tensors, but copy bytes just as well."""
    return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes
