"""The gated MLP activation in plain torch: the specification and the fallback."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """``silu(gate) * up`` for the fused projection output ``[gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
