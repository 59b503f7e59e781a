"""Block-quantized linear layers for the CPU in C: the wrapper that checks what the kernel
(``quant_linear.c``) reads. The format is ``kernels.reference.quant.QuantizedWeight``."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from kernels.cpu.build import build_library
from kernels.reference.quant import QuantizedWeight

_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGTYPES: list[Any] = [_P, _I, _I, _P, _P, _P, _I, _I, _I, _N, _N, _N, _P, _P, _N]
PATHS = {2: "avx512-vnni", 1: "avx2", 0: "portable C"}


class CpuQuantLinear:
    """The compiled kernel. ``defines`` force a lower instruction-set path (tests):
    ``("ARBOR_QUANT_NO_AVX512",)`` or ``("ARBOR_QUANT_SCALAR",)``."""

    def __init__(self, cache_dir: Path, defines: tuple[str, ...] = ()) -> None:
        lib = build_library("quant_linear", cache_dir, defines)
        self._fn = lib.arbor_quant_linear
        self._fn.argtypes, self._fn.restype = _ARGTYPES, ctypes.c_int
        self._dequantize = lib.arbor_dequantize
        self._dequantize.argtypes = [_P, _P, _P, _I, _I, _I, _I, _N, _N, _N, _P, _N, _N]
        self._dequantize.restype = None
        lib.arbor_quant_path.restype = ctypes.c_int
        self.path = PATHS[lib.arbor_quant_path()]  # the instruction set this build uses
        lib.arbor_quant_has_bf16.restype = ctypes.c_int
        # AVX512_BF16 here: large batches run as a oneDNN bf16 matmul (kernels/dispatch.py)
        self.has_bf16 = bool(lib.arbor_quant_has_bf16())
        lib.arbor_quant_tiles.restype = ctypes.c_int
        # the AVX-512 VNNI path, which multiplies weights in the tiled layout (the faster:
        # reference.quant.tile); the other paths take the row layout only
        self.tiles = bool(lib.arbor_quant_tiles())

    def supports(self, x: torch.Tensor, weight: QuantizedWeight) -> bool:
        """fp32 activations and weight tensors on the CPU, in a layout this build reads
        (otherwise: the reference)."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.codes.device.type == "cpu"
                and (self.tiles or not weight.tiled))

    def __call__(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:  # [..., K] -> [..., N] float32
        if x.shape[-1] != weight.in_features:
            raise ValueError(f"expected {weight.in_features} input features, got {x.shape[-1]}")
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (weight.out_features,)):
            raise ValueError(f"bias must be fp32 [{weight.out_features}], got {bias.dtype} {tuple(bias.shape)}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, weight.in_features).contiguous()
        out = torch.empty(flat.shape[0], weight.out_features, dtype=torch.float32)
        if flat.shape[0] == 0:
            return out.view(*lead, weight.out_features)
        b = bias.contiguous() if bias is not None else None
        status = self._fn(
            flat.data_ptr(), flat.shape[0], weight.in_features, weight.codes.data_ptr(),
            weight.scales.data_ptr(), weight.offsets.data_ptr(), weight.out_features,
            weight.padded_features, weight.num_groups, weight.group_shift, weight.bits, int(weight.tiled),
            None if b is None else b.data_ptr(), out.data_ptr(), torch.get_num_threads(),
        )
        if status == -2:
            raise ValueError(f"this build of the kernel ({self.path}) takes weights in the row layout only")
        if status != 0:
            raise MemoryError("quant_linear: could not allocate the quantized activations")
        return out.view(*lead, weight.out_features)

    def dequantize(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        """``reference.quant.dequantize``, bit for bit, in one pass over the codes; with
        ``dtype=torch.bfloat16`` those values rounded as ``Tensor.bfloat16()`` rounds them."""
        if weight.codes.device.type != "cpu":
            raise ValueError(f"the C dequantize reads CPU tensors, got {weight.codes.device}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the C dequantize writes float32 or bfloat16, not {dtype}")
        out = torch.empty(weight.out_features, weight.in_features, dtype=dtype)
        codes, scales, offsets = (t.contiguous() for t in (weight.codes, weight.scales, weight.offsets))
        self._dequantize(
            codes.data_ptr(), scales.data_ptr(), offsets.data_ptr(), weight.out_features,
            weight.in_features, weight.padded_features, weight.num_groups, weight.group_shift,
            weight.bits, int(weight.tiled), out.data_ptr(), int(dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        return out
