"""Triton paged extend (prefill) attention: new tokens over their cached prefix and themselves.

Spec: ``kernels.reference.attention.extend_attention``. Grid ``[B, Hq, cdiv(max_extend,
BLOCK_M)]``: one program per (request, query head, tile of BLOCK_M new tokens), a
flash-attention loop over keys read through the page table. The new tokens' K/V are already
in the pool, so one request's keys are positions ``0 .. seq_len - 1`` of its pages::

    positions  0 ............ prefix_len-1 | prefix_len ........ seq_len-1
               cached prefix (loop 1)      | new tokens (loop 2, causal)
    new token i (position prefix_len + i) sees positions 0 .. prefix_len + i

Loop 1 needs no causal mask; loop 2 stops after the tile's last row. With a sliding
window ``W`` both start at the tile's first row's first visible position
(``prefix_len + first row - W + 1``) and mask each row's keys before its own; with a
soft-cap each scaled score becomes ``c * tanh(s / c)`` (``decode_attention.soft_cap``).
"""

from __future__ import annotations

import math

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
    dot_config,
    scale_args,
)
from kernels.triton.decode_attention import soft_cap
from kernels.triton.paged import load_paged_kv, softmax_step


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, page_table_ptr, prefix_lens_ptr, extend_lens_ptr, qo_indptr_ptr,
    stride_qt, stride_qh,  # q: [T, Hq, D]
    stride_ks, stride_kh, stride_vs, stride_vh,  # pool: [num_slots, Hkv, D]
    stride_ot, stride_oh,  # out: [T, Hq, D]
    stride_pb,  # page_table: [B, max_pages]
    scale_log2, num_kv_heads, head_dim, window, softcap,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, CAP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    q_head = tl.program_id(1)
    m_block = tl.program_id(2)
    extend_len = tl.load(extend_lens_ptr + b).to(tl.int32)
    if m_block * BLOCK_M < extend_len:
        kv_head = q_head // GROUP
        prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)
        q_start = tl.load(qo_indptr_ptr + b).to(tl.int64)
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # new-token index within request
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < extend_len
        mask_d = offs_d < head_dim
        mask_md = mask_m[:, None] & mask_d[None, :]
        rows = q_start + offs_m  # [BLOCK_M] int64, rows of q / out
        q_ptrs = q_ptr + rows[:, None] * stride_qt + q_head * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_md, other=0.0)  # [BLOCK_M, BLOCK_D]
        if DOT_FP32:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        page_row_ptr = page_table_ptr + b.to(tl.int64) * stride_pb
        k_head = kv_head * stride_kh
        v_head = kv_head * stride_vh

        q_pos = prefix_len + offs_m  # [BLOCK_M]
        first = prefix_len * 0  # the first position any row of the tile sees (NOTE: a tensor on both branches)
        lo = tl.zeros([BLOCK_M], tl.int32)  # each row's first visible position
        if window > 0:
            lo = tl.maximum(q_pos - window + 1, 0)
            first = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0)

        # Loop 1: the cached prefix, visible to every new token (but for a window).
        for n0 in range(tl.minimum(first, prefix_len), prefix_len, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            mask_n = pos < prefix_len
            k, v = load_paged_kv(
                k_ptr, v_ptr, stride_ks, stride_vs, k_head, v_head,
                ks_ptr, vs_ptr, num_kv_heads, kv_head,
                page_row_ptr, pos, mask_n, offs_d, mask_d, PAGE_SIZE, DOT_FP32, QUANT,
            )  # fmt: skip
            # [BLOCK_M, BLOCK_N] scores in the log2 domain
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            if CAP:
                qk = soft_cap(qk, softcap)
            qk = tl.where(mask_n[None, :] & (pos[None, :] >= lo[:, None]), qk, float("-inf"))
            acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, DOT_PRECISION)

        # Loop 2: the new tokens up to this tile's last row, causal.
        causal_end = prefix_len + tl.minimum((m_block + 1) * BLOCK_M, extend_len)
        for n0 in range(tl.maximum(first, prefix_len), causal_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            mask_n = pos < causal_end
            k, v = load_paged_kv(
                k_ptr, v_ptr, stride_ks, stride_vs, k_head, v_head,
                ks_ptr, vs_ptr, num_kv_heads, kv_head,
                page_row_ptr, pos, mask_n, offs_d, mask_d, PAGE_SIZE, DOT_FP32, QUANT,
            )  # fmt: skip
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            if CAP:
                qk = soft_cap(qk, softcap)
            allowed = mask_n[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= lo[:, None])
            qk = tl.where(allowed, qk, float("-inf"))
            acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, DOT_PRECISION)

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # NOTE: a padding row may see no key
        out_ptrs = out_ptr + rows[:, None] * stride_ot + q_head * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_md)


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D], new tokens of all requests, request after request
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    page_table: torch.Tensor,  # [B, max_pages] int32/int64
    prefix_lens: torch.Tensor,  # [B] int32/int64, cached tokens before the new ones (may be 0)
    extend_lens: torch.Tensor,  # [B] int32/int64, new tokens per request (>= 1)
    qo_indptr: torch.Tensor,  # [B+1] int32/int64, offsets of each request's tokens in q
    page_size: int,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an int8 / fp8 pool
    v_scale: torch.Tensor | None = None,
    window: int | None = None,  # position p sees p - window + 1 .. p only (>= 1)
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (> 0)
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of new tokens over their cached prefix and each other.

    New token ``i`` of request ``b`` sits at position ``prefix_lens[b] + i`` and attends to
    positions ``0 .. prefix_lens[b] + i``. The new tokens' K/V must already be stored.
    Reads ``max(extend_lens)`` on the host (one sync), as the reference does.

    Returns:
        [T, Hq, D] in ``q``'s dtype.

    Raises:
        ValueError: shapes, dtypes, devices or strides do not match the spec.
    """
    _check_args(q, k_buffer, v_buffer, page_table, prefix_lens, extend_lens, qo_indptr, page_size,
                k_scale, v_scale)
    if window is not None and window < 1:
        raise ValueError(f"an attention window must be >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"an attention soft-cap must be > 0, got {softcap}")
    num_tokens, num_q_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or extend_lens.shape[0] == 0:
        return out
    config = launch_config(head_dim, num_q_heads // k_buffer.shape[1])
    num_m_blocks = triton.cdiv(int(extend_lens.max()), config["BLOCK_M"])  # host sync
    _extend_kernel[(extend_lens.shape[0], num_q_heads, num_m_blocks)](
        q, k_buffer, v_buffer, *scale_args(k_buffer, k_scale, v_scale), out, page_table,
        prefix_lens, extend_lens, qo_indptr,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0),
        scale * math.log2(math.e), k_buffer.shape[1], head_dim, window or 0, softcap or 1.0,
        PAGE_SIZE=page_size, QUANT=k_scale is not None, CAP=softcap is not None,
        **config, **dot_config(q.dtype, k_buffer.dtype, _extend_kernel),
    )  # fmt: skip
    return out


def launch_config(head_dim: int, group: int) -> dict[str, int]:
    """Constexprs and launch options of ``_extend_kernel``.

    8 warps at head dim >= 128 keep a 64 x 128 fp32 accumulator without spilling (ptxas for
    sm_90: ~140 registers a thread, vs ~220 with 4 warps).
    """
    block_d = block_size(head_dim)
    return {
        "GROUP": group,
        "BLOCK_M": 64,
        "BLOCK_N": 64 if block_d <= 128 else 32,
        "BLOCK_D": block_d,
        "num_warps": 8 if block_d >= 128 else 4,
        "num_stages": 2,
    }


def _check_args(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    page_size: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Validate an extend call (sizes only: the lengths' values are not read)."""
    device, (_, num_kv_heads, head_dim) = check_pool(k_buffer, v_buffer, k_scale, v_scale)
    num_q_heads = check_tensor("q", q, (None, None, head_dim), FLOAT_DTYPES, device).shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    batch = check_tensor("extend_lens", extend_lens, (None,), INDEX_DTYPES, device).shape[0]
    check_tensor("prefix_lens", prefix_lens, (batch,), INDEX_DTYPES, device)
    check_tensor("qo_indptr", qo_indptr, (batch + 1,), INDEX_DTYPES, device)
    check_tensor("page_table", page_table, (batch, None), INDEX_DTYPES, device)
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    check_launchable(device, _extend_kernel)
