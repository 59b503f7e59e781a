"""The attention step of one forward pass over the paged KV pool.

``AttentionMetadata`` is built once per forward pass (shared by every layer); each layer
stores its new K/V into the pool, then runs extend attention for the prefill part and
decode attention for the decode part, through ``kernels.dispatch`` only.

Token order in a forward pass (T = num_extend_tokens + num_decode)::

    [ req0 new tokens | req1 new tokens | ... | dec0 | dec1 | ... ]
      <------- extend part (ragged) ------->   <- one token each ->
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from kernels import AttentionPlan
from runtime.model.kv_cache import KVCache


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each request's tokens live in the pool; built by the model runner per step."""

    kv: KVCache
    out_slots: torch.Tensor  # [T] int64, pool slot receiving each new token's K/V
    num_extend_tokens: int  # tokens [0, num_extend_tokens) are prefill tokens
    extend_page_table: torch.Tensor  # [Be, max_pages] int32
    extend_prefix_lens: torch.Tensor  # [Be] int32, tokens already cached per request
    extend_lens: torch.Tensor  # [Be] int32, new tokens per request
    extend_qo_indptr: torch.Tensor  # [Be + 1] int32, offsets into the extend part
    decode_page_table: torch.Tensor  # [Bd, max_pages] int32
    decode_seq_lens: torch.Tensor  # [Bd] int32, cached tokens incl. the new one
    # The torch path's attention plans (slots, masks, shared prefixes), built once per
    # forward pass and used by every layer; None on the Triton path, which needs none.
    extend_plan: AttentionPlan | None = None
    decode_plan: AttentionPlan | None = None
    # The same for each sliding window W the model's layers use: W -> (extend, decode)
    # plans that also hide keys W or more positions behind the query (the torch path's;
    # the native CPU decode kernel reads their page tables).
    window_plans: dict[int, tuple[AttentionPlan | None, AttentionPlan | None]] = field(default_factory=dict)
    # Prefill rows through the row-invariant kernel where there is one (``kernels.extend_attention``)
    invariant: bool = True

    @property
    def num_extend_reqs(self) -> int:
        return int(self.extend_lens.shape[0])

    @property
    def num_decode(self) -> int:
        return int(self.decode_seq_lens.shape[0])


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    layer_idx: int,
    scale: float,
    meta: AttentionMetadata,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Store the new K/V (quantized, in an int8 / fp8 pool), then attend over the pool
    (extend part, then decode part); with a ``window``, over each query's last ``window``
    positions only (``meta.window_plans``); with a ``softcap``, scores are soft-capped
    (``cap * tanh(s / cap)``, Gemma 2)."""
    k_buf, v_buf, k_scale, v_scale = meta.kv.layer(layer_idx)
    kernels.store_kv(k_buf, v_buf, k, v, meta.out_slots, k_scale, v_scale)
    page_size = meta.kv.page_size
    split = meta.num_extend_tokens
    extend_plan, decode_plan = (meta.extend_plan, meta.decode_plan) if window is None \
        else meta.window_plans.get(window, (None, None))
    parts = []
    if meta.num_extend_reqs:
        parts.append(kernels.extend_attention(
            q[:split], k_buf, v_buf, meta.extend_page_table, meta.extend_prefix_lens,
            meta.extend_lens, meta.extend_qo_indptr, page_size, scale, extend_plan,
            k_scale, v_scale, window, softcap, meta.invariant,
        ))
    if meta.num_decode:
        parts.append(kernels.decode_attention(
            q[split:], k_buf, v_buf, meta.decode_page_table, meta.decode_seq_lens, page_size, scale,
            decode_plan, k_scale, v_scale, window, softcap,
        ))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
