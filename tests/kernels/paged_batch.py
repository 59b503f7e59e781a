"""Build small paged KV pools and batches for the kernel tests, plus a naive oracle.

Pool layout of a built batch (page_size P, requests get pages in scrambled order)::

    page 0            reserved, finite values (the reference reads slot 0 for padding)
    pages 1 .. n      the requests' pages, handed out in a random permutation
    spare pages       NaN: any kernel that reads them poisons its output
    page-table padding columns hold GARBAGE_PAGE (out of range): they must never be read
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GARBAGE_PAGE = 1_000_000
NUM_SPARE_PAGES = 3


@dataclass(frozen=True)
class PagedBatch:
    """One layer's pool and the page tables / lengths of a batch of requests."""

    k_buffer: torch.Tensor  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor  # [num_slots, Hkv, D]
    page_table: torch.Tensor  # [B, max_pages + 2] int32, padded with GARBAGE_PAGE
    prefix_lens: torch.Tensor  # [B] int32, cached tokens before the new ones
    extend_lens: torch.Tensor  # [B] int32, new tokens (already in the pool)
    qo_indptr: torch.Tensor  # [B+1] int32, offsets of each request's new tokens
    page_size: int

    @property
    def seq_lens(self) -> torch.Tensor:  # [B] int32
        return self.prefix_lens + self.extend_lens


def make_paged_batch(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """A pool holding every request's ``prefix + extend`` tokens, pages scrambled."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_used = sum(pages_per_req)
    num_pages = 1 + num_used + NUM_SPARE_PAGES
    order = (torch.randperm(num_used, generator=gen) + 1).tolist()  # scrambled pages 1..n

    max_pages = max(pages_per_req, default=0) + 2
    page_table = torch.full((len(seq_lens), max_pages), GARBAGE_PAGE, dtype=torch.int32)
    for b, n in enumerate(pages_per_req):
        page_table[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]

    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=gen).to(dtype)
    v_buffer = torch.randn(shape, generator=gen).to(dtype)
    spare = slice((1 + num_used) * page_size, None)
    k_buffer[spare] = float("nan")
    v_buffer[spare] = float("nan")
    return PagedBatch(
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        page_table=page_table,
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        extend_lens=torch.tensor(extend_lens, dtype=torch.int32),
        qo_indptr=torch.tensor(
            [0, *torch.tensor(extend_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        page_size=page_size,
    )


def random_q(
    num_rows: int, num_q_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1
) -> torch.Tensor:
    """[num_rows, Hq, D] queries."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_rows, num_q_heads, head_dim), generator=gen).to(dtype)


def naive_attention(
    q: torch.Tensor,  # [T, Hq, D], new tokens request after request
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D] fp32
    """Per-request ``F.scaled_dot_product_attention`` on K/V gathered by walking the page
    table in Python, GQA by ``repeat_interleave``: an oracle independent of the reference.
    ``window``: position p sees p - window + 1 .. p only; ``softcap``: scores become
    ``softcap * tanh(s / softcap)`` (an explicit softmax)."""
    outs = []
    for b in range(batch.page_table.shape[0]):
        prefix, ext = int(batch.prefix_lens[b]), int(batch.extend_lens[b])
        slots = [
            int(batch.page_table[b, p // batch.page_size]) * batch.page_size + p % batch.page_size
            for p in range(prefix + ext)
        ]
        k = batch.k_buffer[slots].float().transpose(0, 1)  # [Hkv, L, D]
        v = batch.v_buffer[slots].float().transpose(0, 1)
        start = int(batch.qo_indptr[b])
        qb = q[start : start + ext].float().transpose(0, 1)  # [Hq, ext, D]
        group = qb.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        # new token i (position prefix + i) sees positions 0 .. prefix + i
        q_pos, k_pos = prefix + torch.arange(ext)[:, None], torch.arange(prefix + ext)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        if softcap is None:
            out = F.scaled_dot_product_attention(qb, k, v, attn_mask=allowed, scale=scale)
        else:
            scores = softcap * torch.tanh(qb @ k.transpose(1, 2) * scale / softcap)
            out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        outs.append(out.transpose(0, 1))  # [ext, Hq, D]
    return torch.cat(outs, dim=0)


@dataclass(frozen=True)
class QuantizedBatch:
    """``batch``'s pool stored in 8 bits (``kernels.reference.kv_quant``)."""

    k_codes: torch.Tensor  # [num_slots, Hkv, D] int8 / float8_e4m3fn
    v_codes: torch.Tensor
    k_scale: torch.Tensor  # [num_slots, Hkv] fp32
    v_scale: torch.Tensor
    dequantized: PagedBatch  # the same batch over the codes' fp32 values (oracle input)


def quantize_batch(batch: PagedBatch, dtype: torch.dtype) -> QuantizedBatch:
    """Quantize every row of ``batch``'s pool (NaN spare rows stay poisonous: NaN scales)."""
    from dataclasses import replace

    from kernels import dequantize_kv, quantize_kv

    k_codes, k_scale = quantize_kv(batch.k_buffer, dtype)
    v_codes, v_scale = quantize_kv(batch.v_buffer, dtype)
    plain = replace(batch, k_buffer=dequantize_kv(k_codes, k_scale), v_buffer=dequantize_kv(v_codes, v_scale))
    return QuantizedBatch(k_codes, v_codes, k_scale, v_scale, plain)
