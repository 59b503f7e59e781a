"""Quantizing ``store_kv`` for an int8 / fp8 KV pool in C (``store_kv.c``): the wrapper
that checks what the kernel reads and writes. A float pool needs no kernel (one
``index_copy_`` per buffer is already one pass)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from kernels.cpu.build import build_library

_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES: list[Any] = [_P, _I, _P, _P, _P, ctypes.c_int, _I, _I, _I, _I]
KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2}  # as in store_kv.c


class CpuStoreKV:
    """The compiled kernel; ``__call__`` has the reference's argument order."""

    def __init__(self, cache_dir: Path) -> None:
        self._fn = build_library("store_kv", cache_dir).arbor_store_kv_quant
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    @staticmethod
    def supports(k_buffer: torch.Tensor, k: torch.Tensor) -> bool:
        """An 8-bit CPU pool and fp32 rows with contiguous heads (otherwise: the reference)."""
        return (k_buffer.device.type == "cpu" and k_buffer.dtype in KINDS and k.dtype == torch.float32
                and k.dim() == 3 and k.stride(2) == 1 and k.stride(1) == k.shape[2])

    def __call__(
        self,
        k_buffer: torch.Tensor,  # [num_slots, Hkv, D] int8 / float8_e4m3fn, contiguous
        v_buffer: torch.Tensor,
        k: torch.Tensor,  # [T, Hkv, D] fp32, heads contiguous (token stride free)
        v: torch.Tensor,
        slot_idx: torch.Tensor,  # [T] int64
        k_scale: torch.Tensor,  # [num_slots, Hkv] fp32, contiguous
        v_scale: torch.Tensor,
    ) -> None:
        slots = slot_idx.to(torch.int64).contiguous()
        for buf, scales, x in ((k_buffer, k_scale, k), (v_buffer, v_scale, v)):
            if not (self.supports(buf, x) and buf.is_contiguous() and x.shape[1:] == buf.shape[1:]):
                raise ValueError(f"store_kv: rows {tuple(x.shape)} {x.dtype} do not fit the pool "
                                 f"{tuple(buf.shape)} {buf.dtype}")
            if scales.dtype != torch.float32 or scales.shape != buf.shape[:2] or not scales.is_contiguous():
                raise ValueError(f"store_kv: scales must be contiguous fp32 {list(buf.shape[:2])}")
            if x.shape[0] != slots.shape[0]:
                raise ValueError(f"store_kv: {x.shape[0]} rows for {slots.shape[0]} slots")
            status = self._fn(x.data_ptr(), x.stride(0), slots.data_ptr(), buf.data_ptr(), scales.data_ptr(),
                              KINDS[buf.dtype], x.shape[0], x.shape[1], x.shape[2], buf.shape[0])
            if status:
                raise ValueError("store_kv: a slot lies outside the KV pool")
