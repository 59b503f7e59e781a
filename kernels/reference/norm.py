"""RMSNorm in plain torch: the specification and the CPU path."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden]
    """``weight * (x / sqrt(mean(x**2) + eps))`` over the last dim (Llama's RMSNorm).

    The normalization runs in fp32 and is rounded to ``x``'s dtype before the weight is
    applied, as in HF transformers; the result has the promoted dtype of ``x`` and ``weight``.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,  # [..., hidden], a layer's output
    residual: torch.Tensor,  # [..., hidden], the residual stream so far
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual)
    """The residual add before a norm, fused: ``residual + x`` and its ``rms_norm``.

    The new residual is returned; an implementation may write it into ``residual`` in
    place (the native CPU kernel does), so callers must not use ``residual`` afterwards.
    """
    summed = residual + x
    return rms_norm(summed, weight, eps), summed
