"""Paged attention in plain torch: the specification and the CPU path.

Efficient on the CPU: one gather of the batch's KV slots (``index_select``) and one fused
SDPA call, no Python loop over requests. GQA is handled by viewing the query heads as
``[num_kv_heads, group, ...]`` so K and V are never repeated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels.reference.kv_quant import as_bytes, dequantize_kv, is_quantized_kv, quantize_kv


def store_kv(
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    slot_idx: torch.Tensor,  # [T] int64, pool slot of each token
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an 8-bit pool
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write the K/V of ``T`` new tokens into their pool slots (in place).

    An int8 / fp8 pool (``kv_quant``) stores codes in the buffers and each row's scale in
    ``k_scale`` / ``v_scale``, which it then requires.
    """
    # NOTE: index_copy_/index_select, not advanced indexing: on the CPU the latter is
    # ~30x slower on a large pool.
    if is_quantized_kv(k_buffer.dtype):
        if k_scale is None or v_scale is None:
            raise ValueError(f"a {k_buffer.dtype} KV pool needs k_scale and v_scale")
        for buf, scales, x in ((k_buffer, k_scale, k), (v_buffer, v_scale, v)):
            codes, scale = quantize_kv(x, buf.dtype)
            as_bytes(buf).index_copy_(0, slot_idx, as_bytes(codes))
            scales.index_copy_(0, slot_idx, scale)
        return
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


def _gather(buffer: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``buffer[slots]`` for slots [B, L] → [B, L, Hkv, D], via index_select (fast on CPU);
    an 8-bit pool's rows come back dequantized (fp32) with their ``scale`` [num_slots, Hkv]."""
    flat = slots.reshape(-1)
    if not is_quantized_kv(buffer.dtype):
        rows = buffer.index_select(0, flat)
    elif scale is None:
        raise ValueError(f"a {buffer.dtype} KV pool needs its scales (k_scale, v_scale)")
    else:
        codes = as_bytes(buffer).index_select(0, flat).view(buffer.dtype)
        rows = dequantize_kv(codes, scale.index_select(0, flat))
    return rows.view(*slots.shape, *buffer.shape[1:])


def _attend(
    q: torch.Tensor,  # [B, Lq, Hq, D]
    k: torch.Tensor,  # [B, Lk, Hkv, D]
    v: torch.Tensor,  # [B, Lk, Hkv, D]
    mask: torch.Tensor | None,  # [B, 1, G*Lq, Lk] additive, q's dtype (see AttentionPlan)
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Lq, Hq, D], log-sum-exp [B, Lq, Hq]
    batch, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    # [B, Hkv, G*Lq, D]: the G query heads sharing a KV head become extra query rows, so
    # K/V are never repeated and torch's fused CPU SDPA kernel does the rest.
    qg = q.view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, num_kv_heads, group * q_len, head_dim)
    out, lse = _sdpa_with_lse(qg, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), mask, scale,
                              softcap)
    out = out.view(batch, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    lse = lse.view(batch, num_kv_heads, group, q_len).permute(0, 3, 1, 2)
    return out.reshape(batch, q_len, num_q_heads, head_dim), lse.reshape(batch, q_len, num_q_heads)


def _causal_kernel(device: torch.device) -> bool:
    """Whether ``_attend_causal`` can run on ``device`` (torch's fused CPU kernel)."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _attend_causal(
    q: torch.Tensor,  # [B, L, Hq, D]
    k: torch.Tensor,  # [B, L, Hkv, D]
    v: torch.Tensor,  # [B, L, Hkv, D]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, L, Hq, D], log-sum-exp [B, L, Hq]
    """Query i over keys 0..i. The fused CPU kernel skips key blocks past the diagonal
    (about half the work of the masked call) and takes the KV heads of a GQA model as
    they are, so the query heads stay rows of their own."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), 0.0, True,
        scale=scale,
    )
    return out.transpose(1, 2), lse.transpose(1, 2)


def _sdpa_with_lse(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, H, Lk, D]
    v: torch.Tensor,  # [B, H, Lk, D]
    mask: torch.Tensor | None,  # [B, 1, Lq, Lk] additive (0 or -inf), q's dtype
    scale: float,
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap), before the mask
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, H, Lq, D], [B, H, Lq]
    """SDPA that also returns each row's log-sum-exp (natural log) of the scaled scores."""
    if q.device.type == "cpu" and softcap is None and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        # The kernel behind F.scaled_dot_product_attention on the CPU.
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
        return out, lse
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return torch.matmul(probs, v), lse


@dataclass(frozen=True)
class SharedPrefix:
    """Leading KV pages that several requests of one batch hold in common.

    With a radix prefix cache, requests that share a prompt prefix point at the very same
    pages, so attention over those keys can be computed once for all of their queries
    (one K/V read) and merged with each request's attention over the rest of its pages.
    Every shared page must lie wholly before each member's first query position.
    """

    pages: torch.Tensor  # [P] int64, the shared pages in order (P * page_size tokens)
    rows: torch.Tensor  # [n] int64, the members: rows of the batch (requests)


@dataclass(frozen=True)
class _PrefixPart:
    slots: torch.Tensor  # [Ls] int64, the shared pages' slots
    rows: torch.Tensor  # [n] int64, query rows (tokens) that see them


@dataclass(eq=False)
class AttentionPlan:
    """Everything about one attention call that is the same in every layer.

    Built once per forward pass (``plan_decode`` / ``plan_extend``) and handed to each
    layer's call, so the slots, masks and shared-prefix bookkeeping are not recomputed
    30 times. Only the K/V gathers and the attention itself run per layer.
    """

    # [B, L] int64, the pool slots each request reads (padding: slot 0). A decode plan
    # leaves both to ``gather_slots``, which fills them in on first use: the native decode
    # kernel reads the pages in place and never needs them.
    slots: torch.Tensor | None
    allowed: torch.Tensor | None  # [B, Lq, L] bool; None when ``causal`` says it all
    max_q: int  # query rows per request in the padded layout (1 for decode)
    scatter: torch.Tensor | None  # [T] int64: row of each query token in [B * max_q] (extend)
    prefixes: tuple[_PrefixPart, ...]  # shared-prefix parts, merged after the main part
    # Decode only: each row's page table [B, max_pages] int32 and length [B] int32 without
    # the pages a shared prefix covers (what a kernel reading the pages in place needs).
    page_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    page_size: int = 0
    # Extend only: no request has a prefix (after any shared-prefix drop), so query i may
    # see keys 0..i: plain causal attention, where the fused kernel skips the masked half.
    causal: bool = False
    # Decode only: keys ``window`` or more positions behind the query are masked (a sliding
    # window layer); None: none are.
    window: int | None = None
    _masks: dict[tuple[torch.dtype, int], torch.Tensor] = field(default_factory=dict)

    def gather_slots(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``slots``, ``allowed``), filled in on the first call for a decode plan."""
        if self.slots is None:
            assert self.page_table is not None and self.seq_lens is not None, "not a decode plan"
            max_len = int(self.seq_lens.max())
            self.slots, valid = token_slots(self.page_table, self.seq_lens, self.page_size, max_len)
            if self.window is not None:  # the query is at seq_len - 1: keys from seq_len - window on
                pos = torch.arange(max_len, device=valid.device)
                valid &= pos[None, :] >= (self.seq_lens.long() - self.window)[:, None]
            self.allowed = valid[:, None, :]
        return self.slots, self.allowed

    def mask(self, dtype: torch.dtype, group: int) -> torch.Tensor:
        """Additive [B, 1, group * Lq, L] mask for ``group`` query heads per KV head."""
        key = (dtype, group)
        if key not in self._masks:
            slots, allowed = self.gather_slots()
            if allowed is None:  # a causal plan: query i sees keys 0..i (NOTE: no prefix)
                assert self.causal, "a plan without a mask is causal"
                k_pos = torch.arange(slots.shape[1], device=slots.device)
                allowed = (k_pos[None, :] <= torch.arange(self.max_q, device=slots.device)[:, None])[None]
                allowed = allowed.expand(slots.shape[0], self.max_q, slots.shape[1])
            batch, q_len, keys = allowed.shape
            allowed = allowed[:, None, None].expand(batch, 1, group, q_len, keys)
            allowed = allowed.reshape(batch, 1, group * q_len, keys)
            add = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            self._masks[key] = add.masked_fill_(~allowed, -math.inf)
        return self._masks[key]


def plan_decode(
    page_table: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens in cache incl. the new one
    page_size: int,
    shared: Sequence[SharedPrefix] = (),
    window: int | None = None,
) -> AttentionPlan:
    """The layer-independent part of ``decode_attention`` (B >= 1); with a ``window``, each
    query sees its last ``window`` positions only (then no ``shared`` prefixes)."""
    _check_window(window, shared)
    if shared:
        page_table, seq_lens = _drop_leading_pages(
            page_table, seq_lens, _skipped_pages(page_table.shape[0], shared, page_table.device), page_size
        )
    prefixes = tuple(_PrefixPart(_page_slots(g.pages, page_size), g.rows) for g in shared)
    return AttentionPlan(None, None, 1, None, prefixes, page_table=page_table, seq_lens=seq_lens,
                         page_size=page_size, window=window)


def _check_window(window: int | None, shared: Sequence[SharedPrefix]) -> None:
    if window is not None and window < 1:
        raise ValueError(f"an attention window must be >= 1, got {window}")
    if window is not None and shared:
        raise ValueError("a windowed plan reads no shared prefixes (they are merged unmasked)")


def plan_extend(
    page_table: torch.Tensor,  # [B, max_pages] int32
    prefix_lens: torch.Tensor,  # [B] int32
    extend_lens: torch.Tensor,  # [B] int32, >= 1 each
    qo_indptr: torch.Tensor,  # [B+1] int32
    page_size: int,
    shared: Sequence[SharedPrefix] = (),
    window: int | None = None,
) -> AttentionPlan:
    """The layer-independent part of ``extend_attention`` (B >= 1); ``window`` as in
    ``plan_decode``."""
    _check_window(window, shared)
    batch = extend_lens.shape[0]
    device = extend_lens.device
    token_req = torch.repeat_interleave(torch.arange(batch, device=device), extend_lens.long())
    prefixes = []
    for group in shared:
        member = torch.zeros(batch, dtype=torch.bool, device=device)
        member[group.rows] = True
        prefixes.append(_PrefixPart(_page_slots(group.pages, page_size), member[token_req].nonzero().flatten()))
    if shared:
        page_table, prefix_lens = _drop_leading_pages(
            page_table, prefix_lens, _skipped_pages(batch, shared, device), page_size
        )
    seq_lens = (prefix_lens + extend_lens).long()
    max_q, max_k = int(extend_lens.max()), int(seq_lens.max())
    slots, valid = token_slots(page_table, seq_lens, page_size, max_k)
    offset = torch.arange(token_req.shape[0], device=device) - qo_indptr.long()[token_req]
    scatter = token_req * max_q + offset  # row of each token in [B * max_q]
    if _causal_kernel(device) and not bool(prefix_lens.any()) and window is None:
        # NOTE: with no prefix, valid query i of request b sees keys 0..i, all < seq_len[b]:
        # the padding keys past a shorter request are never in a valid query's window
        # (padding query rows see garbage, and are dropped by ``scatter``).
        return AttentionPlan(slots, None, max_q, scatter, tuple(prefixes), causal=True)
    # allowed[b, i, j] = j <= prefix_len[b] + i  and  j < seq_len[b]
    q_pos = prefix_lens.long()[:, None] + torch.arange(max_q, device=device)[None, :]
    k_pos = torch.arange(max_k, device=device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]
    if window is not None:  # and j > prefix_len[b] + i - window
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - window
    return AttentionPlan(slots, allowed, max_q, scatter, tuple(prefixes))


def run_plan(
    q: torch.Tensor,  # [T, Hq, D]: one row per request (decode) or the ragged new tokens (extend)
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    plan: AttentionPlan,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an 8-bit pool
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of ``q`` as planned: one gather of each request's slots, one SDPA call,
    then every shared prefix read once and merged in."""
    num_tokens, heads, dim = q.shape
    slots, _ = plan.gather_slots()
    batch = slots.shape[0]
    group = heads // k_buffer.shape[1]
    k, v = _gather(k_buffer, slots, k_scale), _gather(v_buffer, slots, v_scale)  # [B, L, Hkv, D]
    if plan.scatter is None:  # decode: one query row per request
        out, lse = _attend(q[:, None], k, v, plan.mask(q.dtype, group), scale, softcap)
        out, lse = out[:, 0], lse[:, 0]
    else:  # extend: scatter the ragged queries into [B, max_q, Hq, D]
        q_pad = q.new_zeros(batch * plan.max_q, heads, dim).index_copy_(0, plan.scatter, q)
        q_pad = q_pad.view(batch, plan.max_q, heads, dim)
        if plan.causal and softcap is None:
            out, lse = _attend_causal(q_pad, k, v, scale)
        else:
            out, lse = _attend(q_pad, k, v, plan.mask(q.dtype, group), scale, softcap)
        out = out.reshape(batch * plan.max_q, heads, dim).index_select(0, plan.scatter)
        lse = lse.reshape(batch * plan.max_q, heads).index_select(0, plan.scatter)
    merge_shared_prefixes(out, lse, q, plan, k_buffer, v_buffer, scale, k_scale, v_scale, softcap)
    return out


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one new token per request
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    page_table: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens in cache incl. the new one
    page_size: int,
    scale: float,
    shared: Sequence[SharedPrefix] = (),
    plan: AttentionPlan | None = None,
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an 8-bit pool
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of each request's newest token over all its cached tokens (the last
    ``window`` of them, with a window).

    The new token's K/V must already be stored in the pool. ``shared`` (optional) names
    groups of requests with common leading pages; the result is the same with or without
    it, only cheaper with it (see ``SharedPrefix``). ``plan``: this call's
    ``plan_decode(page_table, seq_lens, page_size, shared)``, when the caller kept it.
    ``k_scale`` / ``v_scale``: the row scales of an int8 / fp8 pool (see ``kv_quant``).
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    plan = plan or plan_decode(page_table, seq_lens, page_size, shared, window)
    return run_plan(q, k_buffer, v_buffer, plan, scale, k_scale, v_scale, softcap)


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
    shared: Sequence[SharedPrefix] = (),
    plan: AttentionPlan | None = None,
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an 8-bit pool
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of new tokens over their cached prefix and each other (with a
    ``window``: position ``p`` sees ``p - window + 1 .. p`` only).

    New token ``i`` of request ``b`` sits at position ``prefix_lens[b] + i`` and attends to
    positions ``0 .. prefix_lens[b] + i``. The new tokens' K/V must already be stored.
    ``shared`` and ``plan`` as in ``decode_attention`` (``plan_extend``).
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    plan = plan or plan_extend(page_table, prefix_lens, extend_lens, qo_indptr, page_size, shared, window)
    return run_plan(q, k_buffer, v_buffer, plan, scale, k_scale, v_scale, softcap)


# ---- shared prefixes ------------------------------------------------------------------------
def _page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:  # [P * page_size] int64
    return (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).reshape(-1)


def _skipped_pages(batch: int, shared: Sequence[SharedPrefix], device: torch.device) -> torch.Tensor:
    """[B] int64: how many leading pages each request hands to its shared group."""
    skip = torch.zeros(batch, dtype=torch.long, device=device)
    for group in shared:
        skip[group.rows] = group.pages.shape[0]
    return skip


def _drop_leading_pages(
    page_table: torch.Tensor, lens: torch.Tensor, skip: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's page table and token count without its first ``skip[b]`` pages."""
    width = page_table.shape[1]
    cols = (torch.arange(width, device=skip.device)[None, :] + skip[:, None]).clamp(max=width - 1)
    return page_table.gather(1, cols.to(page_table.device)), (lens.long() - skip * page_size).to(lens.dtype)


def merge_shared_prefixes(
    out: torch.Tensor,  # [T, Hq, D], attention over the rest of each row's keys; updated in place
    lse: torch.Tensor,  # [T, Hq] float32, its log-sum-exp
    q: torch.Tensor,  # [T, Hq, D]
    plan: AttentionPlan,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an 8-bit pool
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
) -> None:
    """Fold each of ``plan``'s shared prefixes into the rows that hold it."""
    for part in plan.prefixes:
        _merge_prefix(out, lse, q, part, k_buffer, v_buffer, scale, k_scale, v_scale, softcap)


def _merge_prefix(
    out: torch.Tensor,  # [N, Hq, D], updated in place
    lse: torch.Tensor,  # [N, Hq]
    q: torch.Tensor,  # [N, Hq, D]
    part: _PrefixPart,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    softcap: float | None = None,
) -> None:
    """Fold attention over a shared prefix into its rows' partial results.

    The shared keys are read once for all the rows' queries: one unmasked attention call,
    then the two partial softmaxes merge by their log-sum-exps.
    """
    rows = part.rows
    k = _gather(k_buffer, part.slots[None], k_scale)  # [1, Ls, Hkv, D]
    v = _gather(v_buffer, part.slots[None], v_scale)
    every = rows.numel() == out.shape[0]  # the common case: the whole batch shares it
    rows_q = q if every else q.index_select(0, rows)
    pre_out, pre_lse = _attend(rows_q[None], k, v, None, scale, softcap)  # [1, n, Hq, D], [1, n, Hq]
    rest_out = out if every else out.index_select(0, rows)
    rest_lse = lse if every else lse.index_select(0, rows)
    top = torch.maximum(pre_lse[0], rest_lse)
    w_pre, w_rest = torch.exp(pre_lse[0] - top), torch.exp(rest_lse - top)
    merged = torch.addcmul(pre_out[0].float() * w_pre[..., None], rest_out.float(), w_rest[..., None])
    merged = (merged / (w_pre + w_rest)[..., None]).to(out.dtype)
    if every:
        out.copy_(merged)
    else:
        out.index_copy_(0, rows, merged)
