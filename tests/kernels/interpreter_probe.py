"""A trivial Triton kernel that tells whether Triton's CPU interpreter works here.

Imported by ``conftest.py`` only after it sets ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs) * 2)


def interpreter_works() -> bool:
    """Run the probe on CPU tensors; True iff it doubled them."""
    src = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros_like(src)
    _copy_kernel[(1,)](src, dst, N=16)
    return torch.equal(dst, src * 2)
