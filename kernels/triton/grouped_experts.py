"""Triton grouped GEMM for a mixture-of-experts block: rows sorted by expert, each block of
rows multiplied by its one expert's weight.

Spec: ``kernels.reference.moe.grouped_experts`` (float weights). The host cuts every
expert's rows into blocks of BLOCK_M (a block never spans two experts) without a device
sync: there are at most ``S // BLOCK_M + E`` such blocks, and the spare ones are empty::

    block b:  expert[b], rows [start[b], end[b])    (start == end: nothing to do)

The gate_up launch fuses the activation: a program computes the gate and up columns of
its output block together and stores ``silu(gate) * up`` ([S, I], never [S, 2I]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_launchable,
    check_tensor,
    dot_config,
)


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, y_ptr, block_expert_ptr, block_start_ptr, block_end_ptr,
    N, K,  # per expert: output features (I when FUSE_SILU, else the weight's rows), inputs
    stride_x, stride_we, stride_wn, stride_y,
    FUSE_SILU: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    start = tl.load(block_start_ptr + pid_m).to(tl.int64)
    end = tl.load(block_end_ptr + pid_m).to(tl.int64)
    if start < end:
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = start + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m, mask_n = rows < end, cols < N
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mask_k = ks < K
            a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w_mask = mask_k[:, None] & mask_n[None, :]
            b = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)  # [BK, BN]
            if DOT_FP32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
            if FUSE_SILU:  # the up rows: I rows below the gate rows
                u = tl.load(w_base + (cols[None, :] + N) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
                if DOT_FP32:
                    u = u.to(tl.float32)
                acc_up += tl.dot(a, u, input_precision=DOT_PRECISION)
        if FUSE_SILU:
            acc = acc * tl.sigmoid(acc) * acc_up
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


def _blocks(offsets: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(expert, start, end) per block of rows, padded with empty blocks (module docstring)."""
    num_experts = offsets.shape[0] - 1
    per_expert = (offsets[1:] - offsets[:-1] + block_m - 1) // block_m  # [E] blocks
    ends = torch.cumsum(per_expert, 0)
    block = torch.arange(num_rows // block_m + num_experts, device=offsets.device)
    expert = torch.searchsorted(ends, block, right=True)  # E: a spare block
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    start = offsets[e] + (block - ends[e] + per_expert[e]) * block_m
    zero = torch.zeros_like(start)
    return e, torch.where(used, start, zero), torch.where(used, offsets[e + 1], zero)


def _gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, fuse_silu: bool) -> torch.Tensor:
    num_rows, k = x.shape
    n = w.shape[1] // 2 if fuse_silu else w.shape[1]
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block_m, block_n, block_k = 16, 32, 32
    expert, start, end = _blocks(offsets.to(torch.int64), num_rows, block_m)
    dots = dot_config(x.dtype, w.dtype, _grouped_gemm_kernel)
    grid = (expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        x, w, out, expert, start, end, n, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        FUSE_SILU=fuse_silu, **dots, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def grouped_experts(
    x_sorted: torch.Tensor,  # [S, H], rows sorted by expert
    offsets: torch.Tensor,  # [E + 1], expert e's rows are [offsets[e], offsets[e + 1])
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:  # [S, H], each row through its expert's SwiGLU MLP, unweighted
    """Raises:
        ValueError: shapes, dtypes, devices or strides do not match the spec.
    """
    if not isinstance(x_sorted, torch.Tensor) or x_sorted.dim() != 2:
        raise ValueError("x_sorted must be a [S, H] torch.Tensor")
    device, (num_rows, hidden) = x_sorted.device, x_sorted.shape
    check_tensor("x_sorted", x_sorted, (num_rows, hidden), FLOAT_DTYPES, device)
    check_tensor("gate_up", gate_up, (None, None, hidden), FLOAT_DTYPES, device)
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    check_tensor("down", down, (num_experts, hidden, inter), (gate_up.dtype,), device)
    check_tensor("offsets", offsets, (num_experts + 1,), INDEX_DTYPES, device)
    if gate_up.shape[1] != 2 * inter:
        raise ValueError(f"gate_up must have an even number of rows per expert, got {gate_up.shape[1]}")
    check_launchable(device, _grouped_gemm_kernel)
    act = _gemm(x_sorted, gate_up, offsets, fuse_silu=True)  # [S, I]
    return _gemm(act, down, offsets, fuse_silu=False)
