"""Paged prefill ("extend") attention for the CPU in C: the wrapper that checks what the
kernel reads.

The kernel (``extend_attention.c``) computes every new token's attention over its request's
pages in place, each row with the decode kernel's arithmetic (``decode_attention.c``), so
a row's bits do not depend on the call's other rows or keys (docs/invariance.md). Causal,
GQA, an optional sliding window and an optional logit soft-cap; fp32, int8 and fp8 pools.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from kernels.cpu.build import build_library
from kernels.cpu.decode_attention import (
    KV_KINDS,
    MAX_DIM,
    MAX_HEADS,
    check_kv_pool,
    window_and_softcap,
)

_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES: list[Any] = [_P, _P, _P, _P, _P, ctypes.c_int, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I,
                        _I, ctypes.c_float, ctypes.c_float, _I, ctypes.c_int]


class CpuExtendAttention:
    """The compiled kernel; ``__call__`` has the reference's argument order."""

    def __init__(self, cache_dir: Path) -> None:
        self._fn = build_library("extend_attention", cache_dir, with_sources=("decode_attention",)
                                 ).arbor_extend_attention
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    @staticmethod
    def supports(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
        """fp32 CPU queries over an fp32, int8 or fp8 pool within the kernel's head limits."""
        return (q.device.type == "cpu" and q.dtype == torch.float32 and k_buffer.dtype in KV_KINDS
                and q.shape[1] <= MAX_HEADS and q.shape[2] <= MAX_DIM)

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D] fp32, the new tokens request after request
        k_buffer: torch.Tensor,  # [num_slots, Hkv, D], contiguous
        v_buffer: torch.Tensor,  # [num_slots, Hkv, D], contiguous
        page_table: torch.Tensor,  # [B, max_pages] int32
        prefix_lens: torch.Tensor,  # [B] int32, cached tokens before the new ones
        extend_lens: torch.Tensor,  # [B] int32, new tokens per request
        qo_indptr: torch.Tensor,  # [B+1] int32, offsets of each request's tokens in q
        page_size: int,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an int8 / fp8 pool
        v_scale: torch.Tensor | None = None,
        window: int | None = None,  # position p sees p - window + 1 .. p only
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, Hq, D], lse [T, Hq] (natural log)
        num_tokens, heads, dim = q.shape
        num_slots, kv_heads, _ = k_buffer.shape
        window_arg, cap_arg = window_and_softcap(window, softcap)
        kind, scale_ptrs = check_kv_pool(q, k_buffer, v_buffer, k_scale, v_scale)
        batch = int(extend_lens.shape[0])
        for name, t, shape in (("page_table", page_table, (batch, page_table.shape[-1])),
                               ("prefix_lens", prefix_lens, (batch,)), ("extend_lens", extend_lens, (batch,)),
                               ("qo_indptr", qo_indptr, (batch + 1,))):
            if t.dtype != torch.int32 or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be int32 {list(shape)}, got {t.dtype} {list(t.shape)}")
        q = q.contiguous()
        table, prefix, ext, indptr = (t.contiguous() for t in (page_table, prefix_lens, extend_lens, qo_indptr))
        out = torch.empty_like(q)
        lse = torch.empty(num_tokens, heads, dtype=torch.float32)
        if batch == 0 or num_tokens == 0:
            return out, lse
        status = self._fn(q.data_ptr(), k_buffer.data_ptr(), v_buffer.data_ptr(), *scale_ptrs, kind,
                          table.data_ptr(), prefix.data_ptr(), ext.data_ptr(), indptr.data_ptr(), out.data_ptr(),
                          lse.data_ptr(), batch, num_tokens, heads, kv_heads, dim, table.shape[1], page_size,
                          num_slots, scale, cap_arg, window_arg, torch.get_num_threads())
        if status == 1:
            raise ValueError("a length, token offset or page id lies outside q, the page table or the KV pool")
        if status == 3:
            raise MemoryError("extend attention: could not allocate its scratch")
        if status != 0:
            raise ValueError(f"extend attention kernel refused its arguments (status {status})")
        return out, lse
