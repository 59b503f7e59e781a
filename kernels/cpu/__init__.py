"""Native CPU kernels, in C, for the ops where torch's CPU path is far from the machine.

Compiled once per machine on first use (``build.py``) and called through ctypes; each
keeps the torch reference as its specification and its fallback. Today: paged decode
attention (the torch path gathers every request's K/V into a padded copy for SDPA; the
kernel reads the pages in place, ~3.5x faster at batch 32).
"""

from kernels.cpu.build import NativeBuildError
from kernels.cpu.decode_attention import CpuDecodeAttention

__all__ = ["CpuDecodeAttention", "NativeBuildError"]
