"""Native CPU kernels, in C, for the ops where torch's CPU path is far from the machine.

Compiled once per machine on first use (``build.py``) and called through ctypes; each
keeps the torch reference as its specification and its fallback:

- paged decode attention (``decode_attention.c``): the torch path gathers every request's
  K/V into a padded copy for SDPA; the kernel reads the pages in place;
- paged prefill attention (``extend_attention.c``): each new token's row computed as a
  decode of it would be, so its bits do not depend on the call's other rows or keys;
- quantizing store of new K/V into an int8 / fp8 pool (``store_kv.c``): one pass per row
  instead of ~10 tensor ops;
- the small ops of a block (``elementwise.c``): residual add + RMSNorm, SiLU-and-mul,
  rotary embedding in place, each one pass instead of 4-10 torch ops;
- block-quantized linears (``quant_linear.c``): int8 activations against 4- or 8-bit
  weight codes, integer dot products per block (torch's weight-only kernels run far below
  memory bandwidth at decode shapes on this CPU);
- a mixture-of-experts block's experts over quantized weights (``moe_experts.c``): every
  expert's gate_up, activation and down over its rows of a batch sorted by expert, in one
  call and one OpenMP region instead of three kernel calls per active expert;
- the fused decode step (``decode_step.c``): a whole decode forward pass of a model with
  block-quantized weights in one call and one OpenMP region, from the serial pieces of
  the kernels above (``arbor_cpu.h``); its reference is the layer-by-layer path;
- a GGUF file's blocks into the tiled layouts (``gguf_repack.c``): one pass from the file's
  map per weight at load, instead of unpacking and retiling in torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kernels.cpu.build import NativeBuildError
from kernels.cpu.decode_attention import CpuDecodeAttention
from kernels.cpu.decode_step import CpuDecodeStep
from kernels.cpu.elementwise import CpuElementwise
from kernels.cpu.extend_attention import CpuExtendAttention
from kernels.cpu.gguf_repack import CpuGGUFRepack
from kernels.cpu.moe_experts import CpuMoeExperts
from kernels.cpu.quant_linear import CpuQuantLinear
from kernels.cpu.store_kv import CpuStoreKV


@dataclass(frozen=True)
class CpuKernels:
    """Every native CPU kernel, built together."""

    decode_attention: CpuDecodeAttention
    elementwise: CpuElementwise
    store_kv: CpuStoreKV
    quant_linear: CpuQuantLinear
    decode_step: CpuDecodeStep
    moe_experts: CpuMoeExperts
    gguf_repack: CpuGGUFRepack
    extend_attention: CpuExtendAttention

    @classmethod
    def build(cls, cache_dir: Path) -> CpuKernels:
        """Compile (or load from ``cache_dir``) every kernel; raises ``NativeBuildError``."""
        return cls(CpuDecodeAttention(cache_dir), CpuElementwise(cache_dir), CpuStoreKV(cache_dir),
                   CpuQuantLinear(cache_dir), CpuDecodeStep(cache_dir), CpuMoeExperts(cache_dir),
                   CpuGGUFRepack(cache_dir), CpuExtendAttention(cache_dir))


__all__ = ["CpuDecodeAttention", "CpuDecodeStep", "CpuElementwise", "CpuExtendAttention", "CpuGGUFRepack",
           "CpuKernels", "CpuMoeExperts", "CpuQuantLinear",
           "CpuStoreKV", "NativeBuildError"]
