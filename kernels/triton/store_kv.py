"""Triton ``store_kv``: scatter the K/V of new tokens into their pool slots.

Spec: ``kernels.reference.attention.store_kv``. One program per token copies all of its
KV heads (a [Hkv, D] tile) for both K and V, casting to the pool's dtype; into an 8-bit
pool it writes each head row's codes and scale (``kernels.reference.kv_quant``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference.kv_quant import KV_QUANT_QMAX
from kernels.triton.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    block_size,
    check_launchable,
    check_pool,
    check_tensor,
    scale_args,
)


@triton.jit
def _round_half_even(x):
    """torch.round: floor(x + 0.5), minus one on ties that land on an odd integer."""
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _round_to_e4m3(x):
    """fp32 ``x`` (|x| <= 448) rounded to the nearest e4m3 value, ties to even, still fp32.

    NOTE: the cast to fp8 after this is exact. Triton's interpreter (3.9) rounds its own
    fp32 -> fp8 cast wrongly when the mantissa carries into the exponent (126.8 -> 64), so
    the rounding is done here: normals keep 3 of fp32's 23 mantissa bits (add half of the
    dropped 20 bits, plus the kept lsb for ties-to-even; a carry bumps the exponent as it
    should), subnormals (|x| < 2^-6) are multiples of 2^-9."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # -0x100000: ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = _round_half_even(x * 512.0) / 512.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _store_rows(
    x, dst_ptr, scale_ptr, slot, offs_h, mask, num_kv_heads,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr,
):  # fmt: skip
    """Write one token's [BLOCK_H, BLOCK_D] rows: cast, or (QMAX > 0) quantize per head row."""
    if QMAX > 0:
        x = x.to(tl.float32)
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), 1)  # [BLOCK_H]
        scale = tl.where(amax > 0.0, amax / QMAX, 1.0)
        x = x / scale[:, None]
        x = tl.minimum(tl.maximum(x, -QMAX), QMAX)
        x = _round_half_even(x) if IS_INT8 else _round_to_e4m3(x)
        tl.store(scale_ptr + slot * num_kv_heads + offs_h, scale, mask=offs_h < num_kv_heads)
    tl.store(dst_ptr, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_buf_ptr, v_buf_ptr, ks_ptr, vs_ptr, k_ptr, v_ptr, slot_idx_ptr,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,  # pool strides: slot, head
    stride_kt, stride_kh, stride_vt, stride_vh,  # new-token strides: token, head
    num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
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
    _store_rows(k, dst, ks_ptr, slot, offs_h, mask, num_kv_heads, QMAX, IS_INT8)

    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    dst = v_buf_ptr + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :]
    _store_rows(v, dst, vs_ptr, slot, offs_h, mask, num_kv_heads, QMAX, IS_INT8)


def store_kv(
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    slot_idx: torch.Tensor,  # [T] int32/int64, pool slot of each token
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an int8 / fp8 pool
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write the K/V of ``T`` new tokens into their pool slots (in place).

    Slots must be distinct and in range; neither is checked (that would sync the device).

    Raises:
        ValueError: shapes, dtypes, devices or strides do not match the spec.
    """
    device, (num_slots, num_kv_heads, head_dim) = check_pool(k_buffer, v_buffer, k_scale, v_scale)
    num_tokens = check_tensor("k", k, (None, num_kv_heads, head_dim), FLOAT_DTYPES, device).shape[0]
    check_tensor("v", v, (num_tokens, num_kv_heads, head_dim), FLOAT_DTYPES, device)
    check_tensor("slot_idx", slot_idx, (num_tokens,), INDEX_DTYPES, device)
    check_launchable(device, _store_kv_kernel)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k_buffer, v_buffer, *scale_args(k_buffer, k_scale, v_scale), k, v, slot_idx,
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_kv_heads, head_dim,
        BLOCK_H=block_size(num_kv_heads, minimum=1), BLOCK_D=block_size(head_dim, minimum=1),
        QMAX=KV_QUANT_QMAX.get(k_buffer.dtype, 0.0), IS_INT8=k_buffer.dtype == torch.int8,
    )  # fmt: skip
