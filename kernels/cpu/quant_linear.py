"""Block-quantized linear layers for the CPU in C: the wrapper that checks what the kernel
(``quant_linear.c``) reads. The format is ``kernels.reference.quant.QuantizedWeight``."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels.cpu.build import build_library
from kernels.reference.quant import BLOCK, K_ELEMENTS, SUPERBLOCK, TILE_ROWS, QuantizedWeight

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
        self._tile_q4 = lib.arbor_tile_q4_blocks
        self._tile_q4.argtypes = [_P, _I, _I, _I, _N, _P, _P, _P, _N]
        self._tile_q4.restype = None
        self._tile_q4_k = lib.arbor_tile_q4_k_blocks
        self._tile_q4_k.argtypes = [_P, _I, _I, _P, _P, _P, _N]
        self._tile_q4_k.restype = None
        self._tile_q5 = lib.arbor_tile_q5_blocks
        self._tile_q5.argtypes = [_P, _I, _I, _I, _N, _P, _P, _P, _N]
        self._tile_q5.restype = None
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

    def tile_q4_blocks(self, rows: np.ndarray, kind: str, in_features: int) -> QuantizedWeight:
        """``reference.quant.tiled_from_q4_blocks`` in one C pass: Q4_0 / Q4_1 blocks straight
        to the tiled layout (Q4_K: ``tile(from_ggml_blocks(...))``, its scales rounded alike). ``rows``: the address of each output row's blocks (uint64
        [N], N a multiple of 16; e.g. into a file's map), which must stay readable for the call."""
        whole = K_ELEMENTS if kind == "Q4_K" else BLOCK
        if kind not in ("Q4_0", "Q4_1", "Q4_K") or in_features % whole or len(rows) % TILE_ROWS:
            raise ValueError(f"tile_q4_blocks takes Q4_0 / Q4_1 / Q4_K rows of whole blocks in whole tiles, got "
                             f"{kind} {len(rows)} x {in_features}")
        n, kp = len(rows), -(-in_features // SUPERBLOCK) * SUPERBLOCK
        codes = torch.empty(n, kp // 2, dtype=torch.uint8)
        d = torch.empty(n, kp // BLOCK, dtype=torch.float16)
        m = torch.empty_like(d)
        pointers = np.ascontiguousarray(rows, dtype=np.uint64)
        if kind == "Q4_K":
            self._tile_q4_k(pointers.ctypes.data, n, in_features, codes.data_ptr(), d.data_ptr(), m.data_ptr(),
                            torch.get_num_threads())
        else:
            self._tile_q4(pointers.ctypes.data, n, in_features, kp, int(kind == "Q4_1"), codes.data_ptr(),
                          d.data_ptr(), m.data_ptr(), torch.get_num_threads())
        return QuantizedWeight(codes, d, m, 4, 1, in_features, tiled=True)

    def tile_q5_blocks(self, rows: np.ndarray, kind: str, in_features: int) -> QuantizedWeight:
        """``tile(from_ggml_blocks(...))`` of Q5_0 / Q5_1 blocks in one C pass, straight to the
        5-bit tiles; ``rows`` as in ``tile_q4_blocks``."""
        if kind not in ("Q5_0", "Q5_1") or in_features % BLOCK or len(rows) % TILE_ROWS:
            raise ValueError(f"tile_q5_blocks takes Q5_0 / Q5_1 rows of whole blocks in whole tiles, got "
                             f"{kind} {len(rows)} x {in_features}")
        n, kp = len(rows), -(-in_features // SUPERBLOCK) * SUPERBLOCK
        codes = torch.empty(n, kp // SUPERBLOCK * 40, dtype=torch.uint8)
        d = torch.empty(n, kp // BLOCK, dtype=torch.float16)
        m = torch.empty_like(d)
        pointers = np.ascontiguousarray(rows, dtype=np.uint64)
        self._tile_q5(pointers.ctypes.data, n, in_features, kp, int(kind == "Q5_1"), codes.data_ptr(), d.data_ptr(),
                      m.data_ptr(), torch.get_num_threads())
        return QuantizedWeight(codes, d, m, 5, 1, in_features, tiled=True)

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
