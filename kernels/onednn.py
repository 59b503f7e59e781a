"""Linear layers on oneDNN-prepacked weights: the CPU path for every fp32 matmul.

``F.linear`` on the CPU hands a plain row-major weight to the BLAS on every call. For the
shapes of a decode step (a few rows against a wide weight) that runs far below the
machine's memory bandwidth. oneDNN can reorder a weight once, at load, into the blocked
layout its kernels stream fastest; each call then reads that layout directly. This is what
``torch.compile``'s CPU freezing pass does for linears, without compiling anything.

On this CPU the prepacked weight is faster than ``F.linear`` on every shape of the default
model, most at few rows (``benchmarks/bench_linear.py``;
docs/benchmarks.md#onednn_linear).

Results equal ``F.linear`` up to fp32 summation order (relative ~1e-6).
"""

from __future__ import annotations

import torch
from torch import nn


def available() -> bool:
    """True when this torch build carries oneDNN (mkldnn) with the packed-linear ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def _check_packable(weight: torch.Tensor) -> None:
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(
            f"oneDNN prepacking takes a 2-D fp32 CPU weight, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}"
        )


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` reordered once for oneDNN.

    Takes any number of rows (including none); the weight layout does not depend on it.
    The packed tensor is opaque (mkldnn layout): it is not a parameter and does not
    appear in ``state_dict``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        _check_packable(weight)
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def from_linear(cls, linear: nn.Module) -> PackedLinear:
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"expected an nn.Linear, got {type(linear).__name__}")
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
