"""Triton ``store_kv``: scatter the K/V of new tokens into their pool slots.

Spec: ``kernels.reference.attention.store_kv``. One program per token copies all of its
KV heads (a [Hkv, D] tile) for both K and V, casting to the pool's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    block_size,
    check_launchable,
    check_pool,
    check_tensor,
)


@triton.jit
def _store_kv_kernel(
    k_buf_ptr, v_buf_ptr, k_ptr, v_ptr, slot_idx_ptr,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,  # pool strides: slot, head
    stride_kt, stride_kh, stride_vt, stride_vh,  # new-token strides: token, head
    num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_idx_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]

    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    dst = k_buf_ptr + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :]
    tl.store(dst, k.to(k_buf_ptr.dtype.element_ty), mask=mask)

    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    dst = v_buf_ptr + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :]
    tl.store(dst, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    slot_idx: torch.Tensor,  # [T] int32/int64, pool slot of each token
) -> None:
    """Write the K/V of ``T`` new tokens into their pool slots (in place).

    Slots must be distinct and in range; neither is checked (that would sync the device).

    Raises:
        ValueError: shapes, dtypes, devices or strides do not match the spec.
    """
    device, (num_slots, num_kv_heads, head_dim) = check_pool(k_buffer, v_buffer)
    num_tokens = check_tensor("k", k, (None, num_kv_heads, head_dim), FLOAT_DTYPES, device).shape[0]
    check_tensor("v", v, (num_tokens, num_kv_heads, head_dim), FLOAT_DTYPES, device)
    check_tensor("slot_idx", slot_idx, (num_tokens,), INDEX_DTYPES, device)
    check_launchable(device, _store_kv_kernel)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k_buffer, v_buffer, k, v, slot_idx,
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_kv_heads, head_dim,
        BLOCK_H=block_size(num_kv_heads, minimum=1), BLOCK_D=block_size(head_dim, minimum=1),
    )  # fmt: skip
