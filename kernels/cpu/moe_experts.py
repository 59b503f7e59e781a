"""A mixture-of-experts block's experts over block-quantized weights for the CPU in C
(``moe_experts.c``): the wrapper that checks what the kernel reads. The specification is
``kernels.reference.moe.grouped_experts`` with each linear's input rounded to int8 blocks
(``kernels.reference.quant.quantize_activations``), as ``quant_linear.c`` does."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import build_library
from kernels.cpu.decode_step import _QWeight, _qweight
from kernels.reference.moe import ExpertWeights
from kernels.reference.quant import QuantizedWeight

_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class CpuMoeExperts:
    """The compiled kernel (with ``quant_linear.c`` and ``elementwise.c``, whose serial
    pieces it calls)."""

    def __init__(self, cache_dir: Path, defines: tuple[str, ...] = ()) -> None:
        lib = build_library("moe_experts", cache_dir, defines, with_sources=("quant_linear", "elementwise"))
        self._fn = lib.arbor_moe_experts
        self._fn.argtypes = [_P, _I, _P, _I, ctypes.POINTER(_QWeight), ctypes.POINTER(_QWeight), _P, _N]
        self._fn.restype = ctypes.c_int
        lib.arbor_quant_tiles.restype = ctypes.c_int
        self.tiles = bool(lib.arbor_quant_tiles())  # reads tiled weights (quant_linear.py)

    def supports(self, x: torch.Tensor, experts: ExpertWeights) -> bool:
        """Quantized experts and fp32 rows on the CPU, in a layout this build reads."""
        weights = (experts.gate_up, experts.down)
        return (x.device.type == "cpu" and x.dtype == torch.float32
                and all(isinstance(w, QuantizedWeight) and w.codes.device.type == "cpu"
                        and (self.tiles or not w.tiled) for w in weights))

    def __call__(
        self,
        x_sorted: torch.Tensor,  # [S, H] fp32, rows sorted by expert
        offsets: torch.Tensor,  # [E + 1] int64
        experts: ExpertWeights,
    ) -> torch.Tensor:  # [S, H] fp32, each row through its expert, unweighted
        gate_up, down = experts.gate_up, experts.down
        if not (isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)):
            raise ValueError("the C experts kernel multiplies quantized expert weights only")
        e, hidden, inter = experts.num_experts, experts.hidden_size, experts.intermediate_size
        if x_sorted.dim() != 2 or x_sorted.shape[1] != hidden:
            raise ValueError(f"expected rows [S, {hidden}], got {list(x_sorted.shape)}")
        if offsets.dtype != torch.int64 or tuple(offsets.shape) != (e + 1,):
            raise ValueError(f"offsets must be int64 [{e + 1}], got {offsets.dtype} {list(offsets.shape)}")
        rows = x_sorted.shape[0]
        out = torch.empty(rows, hidden, dtype=torch.float32)
        if rows == 0:
            return out
        bounds = offsets.contiguous()
        if bounds[0].item() != 0 or bounds[-1].item() != rows or bool((bounds.diff() < 0).any()):
            raise ValueError(f"offsets must rise from 0 to the {rows} rows")
        x = x_sorted.contiguous()
        gu_w, down_w = _qweight(gate_up, 2 * inter * e, hidden, "gate_up"), _qweight(down, hidden * e, inter, "down")
        status = self._fn(x.data_ptr(), rows, bounds.data_ptr(), e, ctypes.byref(gu_w), ctypes.byref(down_w),
                          out.data_ptr(), torch.get_num_threads())
        if status == -2:
            raise ValueError("this build of the kernel takes expert weights in the row layout only")
        if status != 0:
            raise MemoryError("moe_experts: could not allocate its scratch memory")
        return out
