"""Triton RMSNorm: one program per row, the whole row in one block.

Spec: ``kernels.reference.norm.rms_norm`` (fp32 statistics; the normalized row is rounded
to ``x``'s dtype before the weight multiplies it, as in HF transformers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.checks import FLOAT_DTYPES, block_size, check_launchable, check_tensor


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr,
    stride_x, stride_o,  # row strides of x / out viewed as [N, hidden]
    hidden, eps,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden]
    """``weight * (x / sqrt(mean(x**2) + eps))`` over the last dim; see the reference.

    Raises:
        ValueError: shapes, dtypes, devices or strides do not match the spec, or the leading
            dims of ``x`` cannot be flattened into rows without a copy.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a torch.Tensor with at least one dim")
    hidden = x.shape[-1]
    check_tensor("x", x, (*x.shape[:-1], hidden), FLOAT_DTYPES, x.device)
    check_tensor("weight", weight, (hidden,), FLOAT_DTYPES, x.device)
    check_launchable(x.device, _rms_norm_kernel)
    try:
        rows = x.view(-1, hidden)  # [N, hidden]
    except RuntimeError as exc:
        raise ValueError(f"x's leading dims must flatten without a copy: {exc}") from exc
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0] == 0 or hidden == 0:
        return out
    block = block_size(hidden, minimum=1)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, out, rows.stride(0), hidden, hidden, eps,
        BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out
