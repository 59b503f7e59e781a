"""RMSNorm (with the residual add), SiLU-and-mul and rotary embedding for the CPU in C:
the wrappers that check what the kernels read and write (``elementwise.c``)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from kernels.cpu.build import build_library

_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


class CpuElementwise:
    """The compiled kernels. Each method takes what the torch reference takes and returns
    ``None`` when its inputs are not ones the kernel handles (the caller then runs the
    reference, which raises for shapes that are wrong rather than just unsupported)."""

    def __init__(self, cache_dir: Path) -> None:
        lib = build_library("elementwise", cache_dir)
        self._norm = self._bind(lib.arbor_add_rms_norm, [_P, _P, _P, _P, _I, _I, _F, _N])
        self._silu = self._bind(lib.arbor_silu_and_mul, [_P, _P, _I, _I, _N])
        self._rotary = self._bind(lib.arbor_rotary, [_P, _I, _P, _P, _I, _I, _I, _N])

    @staticmethod
    def _bind(fn: Any, argtypes: list[Any]) -> Any:
        fn.argtypes, fn.restype = argtypes, None
        return fn

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``weight * x / rms(x)`` over the last dim, or None (not fp32 / not contiguous)."""
        if not (_fp32_cpu(x, weight) and x.is_contiguous() and weight.is_contiguous()
                and weight.shape == x.shape[-1:]):
            return None
        out = torch.empty_like(x)
        self._norm(None, x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                   x.shape[-1], eps, torch.get_num_threads())
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(norm of ``x + residual``, ``x + residual``) with the sum written into
        ``residual`` in place; or None."""
        tensors = (x, residual, weight)
        if not (_fp32_cpu(*tensors) and all(t.is_contiguous() for t in tensors)
                and x.shape == residual.shape and weight.shape == x.shape[-1:]):
            return None
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                   x.numel() // x.shape[-1], x.shape[-1], eps, torch.get_num_threads())
        return out, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of ``gate_up = [gate | up]`` [T, 2I] -> [T, I]; or None."""
        if not (_fp32_cpu(gate_up) and gate_up.is_contiguous() and gate_up.dim() == 2
                and gate_up.shape[1] % 2 == 0):
            return None
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out

    def apply_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotate ``x`` [T, H, D] in place by ``cos``/``sin`` [T, 1, D/2]; False when the
        layout is not one the kernel walks (heads contiguous within a token row)."""
        tokens, heads, dim = x.shape
        if not (_fp32_cpu(x, cos, sin) and dim % 2 == 0 and x.stride(2) == 1 and x.stride(1) == dim
                and cos.is_contiguous() and sin.is_contiguous() and cos.numel() == tokens * (dim // 2)
                and sin.shape == cos.shape):
            return False
        self._rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, dim,
                     torch.get_num_threads())
        return True
