"""Paged attention in plain torch: the specification and the CPU path.

Efficient on the CPU: one gather of the batch's KV slots (``index_select``) and one fused
SDPA call, no Python loop over requests. GQA is handled by viewing the query heads as
``[num_kv_heads, group, ...]`` so K and V are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    slot_idx: torch.Tensor,  # [T] int64, pool slot of each token
) -> None:
    """Write the K/V of ``T`` new tokens into their pool slots (in place)."""
    # NOTE: index_copy_/index_select, not advanced indexing: on the CPU the latter is
    # ~30x slower on a large pool.
    k_buffer.index_copy_(0, slot_idx, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, slot_idx, v.to(v_buffer.dtype))


def token_slots(
    page_table: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int, tokens per request
    page_size: int,
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool slots of positions ``0..max_len-1`` for every request.

    Returns:
        slots: [B, max_len] int64; padding positions point at slot 0 (never read unmasked).
        valid: [B, max_len] bool, ``pos < seq_lens[b]``.
    """
    pos = torch.arange(max_len, device=page_table.device)
    valid = pos[None, :] < seq_lens[:, None].to(pos.dtype)
    page_col = (pos // page_size).clamp(max=max(page_table.shape[1] - 1, 0))
    pages = page_table.long().index_select(1, page_col)  # [B, max_len]
    slots = pages * page_size + (pos % page_size)[None, :]
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


def _gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buffer[slots]`` for slots [B, L] → [B, L, Hkv, D], via index_select (fast on CPU)."""
    rows = buffer.index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *buffer.shape[1:])


def _attend(
    q: torch.Tensor,  # [B, Lq, Hq, D]
    k: torch.Tensor,  # [B, Lk, Hkv, D]
    v: torch.Tensor,  # [B, Lk, Hkv, D]
    allowed: torch.Tensor,  # [B, Lq, Lk] bool; every row must allow at least one key
    scale: float,
) -> torch.Tensor:  # [B, Lq, Hq, D]
    batch, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    # [B, Hkv, G*Lq, D]: the G query heads sharing a KV head become extra query rows, so
    # K/V are never repeated and torch's fused CPU SDPA kernel does the rest.
    qg = q.view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, num_kv_heads, group * q_len, head_dim)
    mask = allowed[:, None, None].expand(batch, 1, group, q_len, allowed.shape[-1])
    mask = mask.reshape(batch, 1, group * q_len, allowed.shape[-1])
    out = F.scaled_dot_product_attention(
        qg,
        k.transpose(1, 2).to(q.dtype),
        v.transpose(1, 2).to(q.dtype),
        attn_mask=mask,
        scale=scale,
    )  # [B, Hkv, G*Lq, D]
    out = out.view(batch, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, num_q_heads, head_dim)


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one new token per request
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    page_table: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens in cache incl. the new one
    page_size: int,
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of each request's newest token over all its cached tokens.

    The new token's K/V must already be stored in the pool.
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    max_len = int(seq_lens.max())
    slots, valid = token_slots(page_table, seq_lens, page_size, max_len)
    k, v = _gather(k_buffer, slots), _gather(v_buffer, slots)  # [B, L, Hkv, D]
    out = _attend(q[:, None], k, v, valid[:, None, :], scale)
    return out[:, 0]


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D], new tokens of all requests, request after request
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    page_table: torch.Tensor,  # [B, max_pages] int32
    prefix_lens: torch.Tensor,  # [B] int32, cached tokens before the new ones (may be 0)
    extend_lens: torch.Tensor,  # [B] int32, new tokens per request (>= 1)
    qo_indptr: torch.Tensor,  # [B+1] int32, offsets of each request's tokens in q
    page_size: int,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of new tokens over their cached prefix and each other.

    New token ``i`` of request ``b`` sits at position ``prefix_lens[b] + i`` and attends to
    positions ``0 .. prefix_lens[b] + i``. The new tokens' K/V must already be stored.
    """
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return torch.empty_like(q)
    batch = extend_lens.shape[0]
    seq_lens = (prefix_lens + extend_lens).long()
    max_q, max_k = int(extend_lens.max()), int(seq_lens.max())
    slots, valid = token_slots(page_table, seq_lens, page_size, max_k)
    k, v = _gather(k_buffer, slots), _gather(v_buffer, slots)  # [B, Lk, Hkv, D]

    # Scatter the ragged queries into [B, max_q, Hq, D].
    req = torch.repeat_interleave(torch.arange(batch, device=q.device), extend_lens.long())
    offset = torch.arange(num_tokens, device=q.device) - qo_indptr.long()[req]
    flat = req * max_q + offset  # row of each token in [B * max_q]
    q_pad = q.new_zeros(batch * max_q, q.shape[1], q.shape[2]).index_copy_(0, flat, q)
    q_pad = q_pad.view(batch, max_q, q.shape[1], q.shape[2])

    # allowed[b, i, j] = j <= prefix_len[b] + i  and  j < seq_len[b]
    q_pos = prefix_lens.long()[:, None] + torch.arange(max_q, device=q.device)[None, :]
    k_pos = torch.arange(max_k, device=q.device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]
    out = _attend(q_pad, k, v, allowed, scale)
    return out.reshape(batch * max_q, q.shape[1], q.shape[2]).index_select(0, flat)
