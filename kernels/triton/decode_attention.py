"""Triton paged decode attention: split-K over the sequence, GQA-aware.

Spec: ``kernels.reference.attention.decode_attention``. Two launches:

1. ``_decode_partial_kernel``, grid ``[B, Hkv, num_splits]``: each program takes one request,
   one KV head with the ``G = Hq / Hkv`` query heads that share it (rows of one ``tl.dot``,
   padded to 16, so K/V are read once per group), and one contiguous split of the
   sequence. It writes the split's normalized partial output and its log-sum-exp.
2. ``_decode_reduce_kernel``, grid ``[B, Hq]``: merges the splits of one (request, head).

Split ranges, recomputed identically by both kernels (``_split_range``)::

    split_len = round_up(cdiv(seq_len, S), BLOCK_N)
    split s covers [s * split_len, min((s + 1) * split_len, seq_len))   -- may be empty

Split 0 is empty only when ``seq_len == 0``; that output is zeros, as in the reference.
With a sliding window ``W`` every split is cut to positions ``seq_len - W ..`` (a split
wholly before them is empty); with a soft-cap ``c`` each scaled score ``s`` becomes
``c * tanh(s / c)`` (Gemma 2) before the softmax.
"""

from __future__ import annotations

import functools
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
from kernels.triton.paged import load_paged_kv, softmax_step

MAX_SPLITS = 16  # upper bound on splits per (request, KV head)
MIN_SPLIT_LEN = 256  # tokens; shorter splits cost more in the reduce than they win
PROGRAMS_PER_SM = 8  # target occupancy when choosing the number of splits
CPU_TARGET_PROGRAMS = 64  # the interpreter has no SMs; any fixed target will do


@triton.jit
def _split_range(seq_len, split, window, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(start, end) of a split; with ``window > 0``, cut to the query's window."""
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    if window > 0:
        start = tl.maximum(start, seq_len - window)
    return start, tl.minimum(split * split_len + split_len, seq_len)


@triton.jit
def soft_cap(qk, softcap):
    """Scores in the log2 domain -> soft-capped ones: ``c * tanh(s / c)`` of the natural
    scaled score ``s = qk * ln 2`` (tanh as 2 sigmoid(2x) - 1: Triton has no tanh of its own)."""
    s = qk * 0.6931471805599453
    s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    return s * 1.4426950408889634


@triton.jit
def _mid_row(b, head, split, num_q_heads, NUM_SPLITS: tl.constexpr):
    """Row of (b, head, split) in the contiguous mid buffers: lse [B, Hq, S], o [B, Hq, S, BLOCK_D]."""
    return (b.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + split


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, page_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    stride_qb, stride_qh,  # q: [B, Hq, D]
    stride_ks, stride_kh, stride_vs, stride_vh,  # pool: [num_slots, Hkv, D]
    stride_pb,  # page_table: [B, max_pages]
    scale_log2, num_q_heads, num_kv_heads, head_dim, window, softcap,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, CAP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start, end = _split_range(seq_len, split, window, NUM_SPLITS, BLOCK_N)
    if end > start:
        offs_g = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < GROUP
        mask_d = offs_d < head_dim
        q_heads = kv_head * GROUP + offs_g  # [BLOCK_H], query heads of this KV head
        q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
        if DOT_FP32:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        page_row_ptr = page_table_ptr + b.to(tl.int64) * stride_pb
        k_head = kv_head * stride_kh
        v_head = kv_head * stride_vh
        # NOTE: every tile holds >= 1 position < end, so no row is fully masked.
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            mask_n = pos < end
            k, v = load_paged_kv(
                k_ptr, v_ptr, stride_ks, stride_vs, k_head, v_head,
                ks_ptr, vs_ptr, num_kv_heads, kv_head,
                page_row_ptr, pos, mask_n, offs_d, mask_d, PAGE_SIZE, DOT_FP32, QUANT,
            )  # fmt: skip
            # [BLOCK_H, BLOCK_N] scores in the log2 domain
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            if CAP:
                qk = soft_cap(qk, softcap)
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, DOT_PRECISION)

        mid = _mid_row(b, q_heads, split, num_q_heads, NUM_SPLITS)  # [BLOCK_H]
        out_ptrs = mid_o_ptr + mid[:, None] * BLOCK_D + offs_d[None, :]
        tl.store(out_ptrs, acc / l_i[:, None], mask=mask_g[:, None] & mask_d[None, :])
        tl.store(mid_lse_ptr + mid, m_i + tl.log2(l_i), mask=mask_g)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, seq_lens_ptr, out_ptr,
    stride_ob, stride_oh,  # out: [B, Hq, D]
    num_q_heads, head_dim, window,
    NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim

    m = float("-inf")  # running max of the splits' log-sum-exps
    denom = 0.0  # sum of exp2(lse - m) over the splits merged so far
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(NUM_SPLITS):
        start, end = _split_range(seq_len, split, window, NUM_SPLITS, BLOCK_N)
        if end > start:
            mid = _mid_row(b, head, split, num_q_heads, NUM_SPLITS)
            lse = tl.load(mid_lse_ptr + mid)
            o = tl.load(mid_o_ptr + mid * BLOCK_D + offs_d, mask=mask_d, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + w * o
            denom = denom * alpha + w
            m = m_new
    out = acc / tl.where(denom > 0.0, denom, 1.0)  # seq_len == 0 -> zeros
    out_ptrs = out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one new token per request
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    page_table: torch.Tensor,  # [B, max_pages] int32/int64
    seq_lens: torch.Tensor,  # [B] int32/int64, tokens in cache incl. the new one
    page_size: int,
    scale: float,
    *,
    num_kv_splits: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an int8 / fp8 pool
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of each request's newest token over all its cached tokens (the last
    ``window`` of them, with a window).

    Args:
        num_kv_splits: splits of the sequence per (request, KV head); ``None`` picks one
            from the batch shape and the page table's capacity (no device sync).
        k_scale, v_scale: an 8-bit pool's row scales (required with one).
        window: attend to the last ``window`` positions only (>= 1).
        softcap: scores -> ``softcap * tanh(scores / softcap)`` (> 0).

    Returns:
        [B, Hq, D] in ``q``'s dtype.

    Raises:
        ValueError: shapes, dtypes, devices or strides do not match the spec.
    """
    batch, num_q_heads, head_dim = _check_args(
        q, k_buffer, v_buffer, page_table, seq_lens, page_size, k_scale, v_scale
    )
    if window is not None and window < 1:
        raise ValueError(f"an attention window must be >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"an attention soft-cap must be > 0, got {softcap}")
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    num_kv_heads = k_buffer.shape[1]
    num_splits = num_kv_splits or choose_num_splits(
        batch, num_kv_heads, page_table.shape[1] * page_size, q.device
    )
    if num_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_splits}")
    config = launch_config(head_dim, num_q_heads // num_kv_heads)
    # Contiguous partial results of every (request, query head, split).
    mid_shape = (batch, num_q_heads, num_splits)
    mid_o = torch.empty((*mid_shape, config["BLOCK_D"]), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q.device)

    _decode_partial_kernel[(batch, num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, *scale_args(k_buffer, k_scale, v_scale), page_table, seq_lens,
        mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        page_table.stride(0),
        scale * math.log2(math.e), num_q_heads, num_kv_heads, head_dim, window or 0, softcap or 1.0,
        PAGE_SIZE=page_size, NUM_SPLITS=num_splits, QUANT=k_scale is not None, CAP=softcap is not None,
        **config, **dot_config(q.dtype, k_buffer.dtype, _decode_partial_kernel),
    )  # fmt: skip
    _decode_reduce_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, seq_lens, out, out.stride(0), out.stride(1), num_q_heads, head_dim, window or 0,
        NUM_SPLITS=num_splits, BLOCK_N=config["BLOCK_N"], BLOCK_D=config["BLOCK_D"], num_warps=4,
    )  # fmt: skip
    return out


def launch_config(head_dim: int, group: int) -> dict[str, int]:
    """Constexprs and launch options of ``_decode_partial_kernel`` (the reduce kernel shares
    BLOCK_N and BLOCK_D): the group's query heads padded to 16 rows for ``tl.dot``."""
    block_d = block_size(head_dim)
    return {
        "GROUP": group,
        "BLOCK_H": block_size(group),
        "BLOCK_N": 64 if block_d <= 128 else 32,
        "BLOCK_D": block_d,
        "num_warps": 4,
        "num_stages": 2,
    }


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per (request, KV head): enough programs to fill the GPU, none shorter than
    ``MIN_SPLIT_LEN`` tokens of ``max_seq_len`` (an upper bound; here the page-table
    capacity), at most ``MAX_SPLITS``."""
    by_len = triton.cdiv(max_seq_len, MIN_SPLIT_LEN)
    target = PROGRAMS_PER_SM * _sm_count(device) if device.type == "cuda" else CPU_TARGET_PROGRAMS
    by_grid = triton.cdiv(target, max(batch * num_kv_heads, 1))
    return max(1, min(MAX_SPLITS, by_len, by_grid))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _check_args(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Validate a decode call; returns (B, Hq, D)."""
    device, (_, num_kv_heads, head_dim) = check_pool(k_buffer, v_buffer, k_scale, v_scale)
    batch, num_q_heads, _ = check_tensor("q", q, (None, None, head_dim), FLOAT_DTYPES, device).shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    check_tensor("page_table", page_table, (batch, None), INDEX_DTYPES, device)
    check_tensor("seq_lens", seq_lens, (batch,), INDEX_DTYPES, device)
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    check_launchable(device, _decode_partial_kernel)
    return int(batch), int(num_q_heads), int(head_dim)
