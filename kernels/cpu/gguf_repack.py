"""A GGUF file's blocks straight into the tiled layouts (``gguf_repack.c``): Q6_K to its
6-bit tiles, and any mix of Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K rows to 8-bit tiles with groups
of 32, one C pass each from the rows' addresses (e.g. into the file's memory map)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kernels.cpu.build import build_library
from kernels.reference import q6_k
from kernels.reference.quant import BLOCK, K_ELEMENTS, SUPERBLOCK, TILE_ROWS, QuantizedWeight

# the row kinds arbor_tile8_blocks reads (gguf_repack.c: KIND_*)
TILE8_KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q6_K": 4}
_SUPERBLOCK_KINDS = ("Q4_K", "Q6_K")  # rows of whole 256-element superblocks

_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class CpuGGUFRepack:
    """The compiled repacks. ``defines``: ``("ARBOR_QUANT_SCALAR",)`` for the portable fp16
    conversions (tests)."""

    def __init__(self, cache_dir: Path, defines: tuple[str, ...] = ()) -> None:
        lib = build_library("gguf_repack", cache_dir, defines)
        self._tile_q6_k = lib.arbor_tile_q6_k_blocks
        self._tile_q6_k.argtypes = [_P, _I, _I, _P, _P, _P, _N]
        self._tile_q6_k.restype = None
        self._tile8 = lib.arbor_tile8_blocks
        self._tile8.argtypes = [_P, _P, _I, _I, _I, _P, _P, _P, _N]
        self._tile8.restype = None

    def tile_q6_k_blocks(self, rows: np.ndarray, in_features: int) -> QuantizedWeight:
        """Q6_K rows (``rows``: each output row's address, uint64 [N], N a multiple of 16; they
        must stay readable for the call) as a tiled 6-bit weight: equals
        ``tile(from_ggml_blocks(raw, "Q6_K", in_features))``."""
        if in_features % K_ELEMENTS or len(rows) % TILE_ROWS:
            raise ValueError(f"tile_q6_k_blocks takes rows of whole superblocks in whole tiles, got "
                             f"{len(rows)} x {in_features}")
        n, ns = len(rows), in_features // K_ELEMENTS
        codes = torch.empty(n, ns * q6_k.TILED_ROW_BYTES, dtype=torch.uint8)
        d = torch.empty(n, ns, dtype=torch.float16)
        m = torch.empty_like(d)
        pointers = np.ascontiguousarray(rows, dtype=np.uint64)
        self._tile_q6_k(pointers.ctypes.data, n, in_features, codes.data_ptr(), d.data_ptr(), m.data_ptr(),
                        torch.get_num_threads())
        return QuantizedWeight(codes, d, m, 6, K_ELEMENTS // BLOCK, in_features, tiled=True)

    def tile8_blocks(self, parts: Sequence[tuple[np.ndarray, str]], in_features: int) -> QuantizedWeight:
        """Parts ``(rows, kind)`` stacked in order (each ``rows`` the addresses of that part's
        output rows, in their order; 16 rows in all a multiple) as one tiled 8-bit weight with
        groups of 32: Q8_0 as stored, 4-bit kinds widened, Q6_K requantized to int8 per 32 —
        the torch path's ``_fused`` of those parts, tiled, bit for bit."""
        unknown = sorted({kind for _, kind in parts} - set(TILE8_KINDS))
        whole = K_ELEMENTS if any(kind in _SUPERBLOCK_KINDS for _, kind in parts) else BLOCK
        n = sum(len(rows) for rows, _ in parts)
        if unknown or in_features % whole or n % TILE_ROWS or n == 0:
            raise ValueError(f"tile8_blocks takes rows of {sorted(TILE8_KINDS)} of whole blocks in whole tiles, "
                             f"got {n} rows x {in_features} ({unknown or 'kinds known'})")
        kp = -(-in_features // SUPERBLOCK) * SUPERBLOCK
        codes = torch.empty(n, kp, dtype=torch.uint8)
        d = torch.empty(n, kp // BLOCK, dtype=torch.float16)
        m = torch.empty_like(d)
        pointers = np.ascontiguousarray(np.concatenate([rows for rows, _ in parts]), dtype=np.uint64)
        kinds = np.concatenate([np.full(len(rows), TILE8_KINDS[kind], dtype=np.uint8) for rows, kind in parts])
        self._tile8(pointers.ctypes.data, kinds.ctypes.data, n, in_features, kp, codes.data_ptr(), d.data_ptr(),
                    m.data_ptr(), torch.get_num_threads())
        return QuantizedWeight(codes, d, m, 8, 1, in_features, tiled=True)
