"""Device helpers shared by the paged attention kernels (inlined into them; never launched).

Index arithmetic, for one request with page-table row ``row``::

    position p  ->  page = row[p // PAGE_SIZE]  ->  slot = page * PAGE_SIZE + p % PAGE_SIZE
    K of p, head h  =  k_buffer[slot, h, :]

Each helper call costs the CPU interpreter a lot (it re-patches ``triton.language``), so
the per-tile work is two calls: ``load_paged_kv`` and ``softmax_step``.

Dots: with ``DOT_FP32`` (fp32 or mixed-dtype inputs) q/K/V are upcast once after loading and
every ``tl.dot`` runs with ``input_precision="ieee"`` (exact fp32, not TF32); otherwise the
16-bit operands go to the tensor cores and accumulate in fp32.

Slots are widened to int64 before they are multiplied by a stride: a pool of 2M slots x 8
heads x 128 dims already overflows int32 element offsets.

Jitted functions take untyped arguments (pointers, blocks, ``tl.constexpr``): Triton's
types, not Python's, so they carry no Python type hints.

An 8-bit pool (``QUANT``) holds codes and one fp32 scale per (slot, KV head) in
``[num_slots, Hkv]`` scale buffers: tiles are loaded, upcast to fp32 and multiplied by their
rows' scales (``kernels.reference.kv_quant``); the dots then run in exact fp32.

Online softmax runs in the log2 domain: scores are pre-multiplied by ``scale * log2(e)`` so
``exp2`` replaces ``exp``; a row's log-sum-exp is kept as ``m + log2(l)``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_paged_kv(
    k_ptr, v_ptr, stride_ks, stride_vs, k_head, v_head,  # pool pointers, slot strides, head offsets
    ks_ptr, vs_ptr, num_kv_heads, kv_head,  # an 8-bit pool's scales [num_slots, Hkv] (QUANT)
    page_row_ptr, pos, mask_n, offs_d, mask_d,
    PAGE_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """K and V tiles ([BLOCK_N, BLOCK_D]) of positions ``pos`` of one request.

    Masked positions read page 0 and then nothing: their entries are 0. With ``DOT_FP32``
    the tiles are upcast to fp32 here, once, for the exact-fp32 dots; with ``QUANT`` (which
    implies ``DOT_FP32``) they are dequantized as well.
    """
    page = tl.load(page_row_ptr + pos // PAGE_SIZE, mask=mask_n, other=0)
    slots = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # [BLOCK_N]
    mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_ptr + slots[:, None] * stride_ks + k_head + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + slots[:, None] * stride_vs + v_head + offs_d[None, :], mask=mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if QUANT:
        scale_idx = slots * num_kv_heads + kv_head  # [BLOCK_N]
        k = k * tl.load(ks_ptr + scale_idx, mask=mask_n, other=0.0)[:, None]
        v = v * tl.load(vs_ptr + scale_idx, mask=mask_n, other=0.0)[:, None]
    return k, v


@triton.jit
def softmax_step(acc, l_i, m_i, qk, v, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a key tile.

    Args:
        acc: [M, BLOCK_D] fp32, unnormalized output so far.
        l_i: [M] fp32, sum of exp2(score - m_i) so far.
        m_i: [M] fp32, running max score (log2 domain).
        qk: [M, BLOCK_N] fp32 scores in the log2 domain, -inf where masked.
        v: [BLOCK_N, BLOCK_D] value tile (16-bit, or fp32 for exact fp32 dots).

    A row that has seen no unmasked key yet (a sliding window starts past this tile) keeps
    a zero accumulator: its max stays -inf and is read as 0 here, so no ``-inf - -inf``.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new
