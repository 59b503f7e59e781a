"""Paged decode attention for the CPU in C: the wrapper that checks what the kernel reads.

The kernel (``decode_attention.c``) reads each request's K/V pages once, in place, and
returns the attention output with each row's log-sum-exp, so shared-prefix partial
results merge into it exactly as into the torch reference's.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from kernels.cpu.build import build_library

_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES: list[Any] = [_P, _P, _P, _P, _P, ctypes.c_int, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I,
                        ctypes.c_float, ctypes.c_float, _I, ctypes.c_int]
MAX_HEADS, MAX_DIM = 256, 256  # as in decode_attention.c
# The pool dtypes the kernel reads, by its kv_kind code (int8 / fp8 pools carry scales).
KV_KINDS = {torch.float32: 0, torch.int8: 1, torch.float8_e4m3fn: 2}


class CpuDecodeAttention:
    """The compiled kernel; ``__call__`` has the reference's argument order."""

    def __init__(self, cache_dir: Path) -> None:
        self._fn = build_library("decode_attention", cache_dir).arbor_decode_attention
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    @staticmethod
    def supports(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
        """fp32 CPU queries over an fp32, int8 or fp8 pool within the kernel's head limits
        (otherwise: the reference)."""
        return (q.device.type == "cpu" and q.dtype == torch.float32 and k_buffer.dtype in KV_KINDS
                and q.shape[1] <= MAX_HEADS and q.shape[2] <= MAX_DIM)

    def __call__(
        self,
        q: torch.Tensor,  # [B, Hq, D] fp32
        k_buffer: torch.Tensor,  # [num_slots, Hkv, D] fp32, contiguous
        v_buffer: torch.Tensor,  # [num_slots, Hkv, D] fp32, contiguous
        page_table: torch.Tensor,  # [B, max_pages] int32
        seq_lens: torch.Tensor,  # [B] int32
        page_size: int,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an int8 / fp8 pool
        v_scale: torch.Tensor | None = None,
        window: int | None = None,  # attend to the last ``window`` positions only
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Hq, D], lse [B, Hq] (natural log)
        batch, heads, dim = q.shape
        window_arg, cap_arg = window_and_softcap(window, softcap)
        num_slots, kv_heads, _ = k_buffer.shape
        kind, scale_ptrs = check_kv_pool(q, k_buffer, v_buffer, k_scale, v_scale)
        if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
            raise ValueError("page_table and seq_lens must be int32")
        if page_table.shape[0] != batch or seq_lens.shape != (batch,):
            raise ValueError(f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)} "
                             f"do not match a batch of {batch}")
        q = q.contiguous()
        table, lens = page_table.contiguous(), seq_lens.contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, dtype=torch.float32)
        if batch == 0:
            return out, lse
        status = self._fn(q.data_ptr(), k_buffer.data_ptr(), v_buffer.data_ptr(), *scale_ptrs, kind,
                          table.data_ptr(), lens.data_ptr(), out.data_ptr(), lse.data_ptr(), batch, heads, kv_heads, dim,
                          table.shape[1], page_size, num_slots, scale, cap_arg, window_arg,
                          torch.get_num_threads())
        if status == 1:
            raise ValueError("a sequence length or page id lies outside the page table or the KV pool")
        if status == 3:
            raise MemoryError("decode attention: could not allocate a partial result")
        if status != 0:
            raise ValueError(f"decode attention kernel refused its arguments (status {status})")
        return out, lse


def check_kv_pool(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                  k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[int, tuple[int, int]]:
    """The pool's kind for the C kernels (``KV_KINDS``) and its scale pointers, after checking
    that K and V are one contiguous ``[num_slots, Hkv, D]`` pool that fits ``q`` ``[*, Hq, D]``."""
    if not (k_buffer.is_contiguous() and v_buffer.is_contiguous()) or v_buffer.shape != k_buffer.shape:
        raise ValueError("k_buffer and v_buffer must be contiguous [num_slots, Hkv, D] of one shape")
    if k_buffer.dtype not in KV_KINDS or v_buffer.dtype != k_buffer.dtype:
        raise ValueError(f"the KV pool must be fp32, int8 or fp8 e4m3 (both alike), got "
                         f"{k_buffer.dtype} / {v_buffer.dtype}")
    num_slots, kv_heads, _ = k_buffer.shape
    kind = KV_KINDS[k_buffer.dtype]
    scale_ptrs = scale_pointers(kind, k_scale, v_scale, (num_slots, kv_heads))
    if k_buffer.shape[2] != q.shape[2] or q.shape[1] % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a KV pool of {tuple(k_buffer.shape)}")
    return kind, scale_ptrs


def window_and_softcap(window: int | None, softcap: float | None) -> tuple[int, float]:
    """The C kernels' encoding of a window and a soft-cap (0: none), checked."""
    if window is not None and window < 1:
        raise ValueError(f"an attention window must be >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"an attention soft-cap must be > 0, got {softcap}")
    return window or 0, softcap or 0.0


def scale_pointers(
    kind: int, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, shape: tuple[int, int]
) -> tuple[int, int]:
    """Data pointers of an 8-bit pool's row scales (0, 0 for an fp32 pool), checked."""
    if kind == 0:
        return 0, 0
    for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scales is None or scales.dtype != torch.float32 or tuple(scales.shape) != shape \
                or not scales.is_contiguous():
            raise ValueError(f"an 8-bit KV pool needs {name} as contiguous fp32 {list(shape)}")
    assert k_scale is not None and v_scale is not None
    return k_scale.data_ptr(), v_scale.data_ptr()
