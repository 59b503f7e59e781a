"""Mixture of experts in plain torch: top-k routing, grouping a batch's (token, expert)
pairs by expert, and the experts computed grouped (the specification of
``kernels/cpu/moe_experts.c`` and ``kernels/triton/moe.py``, and their fallback).

The experts' weights are stacked (``ExpertWeights``)::

    gate_up  [E, 2I, H]   expert e: rows [gate (I) | up (I)], as the dense MLP's fused gate_up
    down     [E, H, I]
    quantized: one ``QuantizedWeight`` of E * 2I (E * H) rows; expert e's rows are
    [e * 2I, (e + 1) * 2I), so a per-row or per-group format quantizes each expert alone

A batch of T tokens routed to k experts each becomes S = T * k rows sorted by expert
(``ExpertGroups``): expert e multiplies the contiguous rows [offsets[e], offsets[e + 1])
in one matmul, never a loop over tokens::

    sorted row  0 .. 3 | 4 | 5 .. 9 |          rows of experts 0, 1, 2, ...
    token_idx   which token each row came from (a token appears k times)
    weights     the routing weight of that (token, expert) pair
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.reference.activation import silu_and_mul
from kernels.reference.quant import TILE_ROWS, QuantizedWeight, quantized_linear

ExpertLinear = Callable[[torch.Tensor, "torch.Tensor | QuantizedWeight"], torch.Tensor]


@dataclass(frozen=True)
class ExpertWeights:
    """The experts of one MoE block, stacked (module docstring)."""

    gate_up: torch.Tensor | QuantizedWeight  # [E, 2I, H] float, or quantized [E * 2I, H]
    down: torch.Tensor | QuantizedWeight  # [E, H, I] float, or quantized [E * H, I]
    num_experts: int

    def __post_init__(self) -> None:
        e, (n_gu, h), (n_down, inter) = self.num_experts, _shape(self.gate_up, self.num_experts), \
            _shape(self.down, self.num_experts)
        if e < 1 or n_gu != 2 * inter or n_down != h:
            raise ValueError(f"experts' gate_up must be [E, 2I, H] and down [E, H, I] (E = {e}), got "
                             f"gate_up {n_gu}x{h}, down {n_down}x{inter} per expert")
        if isinstance(self.gate_up, QuantizedWeight) != isinstance(self.down, QuantizedWeight):
            raise ValueError("gate_up and down must both be quantized or both not")
        for name, w in (("gate_up", self.gate_up), ("down", self.down)):
            rows = w.out_features // e if isinstance(w, QuantizedWeight) else 0
            if isinstance(w, QuantizedWeight) and w.tiled and rows % TILE_ROWS:
                raise ValueError(f"a tiled {name} needs a multiple of {TILE_ROWS} rows per expert, got {rows}")

    @property
    def quantized(self) -> bool:
        return isinstance(self.gate_up, QuantizedWeight)

    @property
    def hidden_size(self) -> int:
        return _shape(self.gate_up, self.num_experts)[1]

    @property
    def intermediate_size(self) -> int:
        return _shape(self.down, self.num_experts)[1]

    def expert(self, e: int) -> tuple[torch.Tensor | QuantizedWeight, torch.Tensor | QuantizedWeight]:
        """Expert ``e``'s (gate_up [2I, H], down [H, I]), as views of the stacked weights."""
        return _expert_rows(self.gate_up, e, self.num_experts), _expert_rows(self.down, e, self.num_experts)


def _shape(w: torch.Tensor | QuantizedWeight, num_experts: int) -> tuple[int, int]:  # per expert (N, K)
    if isinstance(w, QuantizedWeight):
        if w.out_features % num_experts:
            raise ValueError(f"{w.out_features} stacked rows do not split into {num_experts} experts")
        return w.out_features // num_experts, w.in_features
    if w.dim() != 3 or w.shape[0] != num_experts:
        raise ValueError(f"expected a [{num_experts}, N, K] expert weight, got {list(w.shape)}")
    return int(w.shape[1]), int(w.shape[2])


def _expert_rows(w: torch.Tensor | QuantizedWeight, e: int, num_experts: int) -> torch.Tensor | QuantizedWeight:
    if not isinstance(w, QuantizedWeight):
        return w[e]
    n = w.out_features // num_experts
    # NOTE: in the tiled layout rows 16t..16t+15 hold tile t, so whole tiles slice like rows
    rows = slice(e * n, (e + 1) * n)
    return QuantizedWeight(w.codes[rows], w.scales[rows], w.offsets[rows], w.bits, w.blocks_per_group,
                           w.in_features, w.tiled)


# ---- routing -------------------------------------------------------------------------------
def route_topk(
    logits: torch.Tensor,  # [T, E] router logits
    top_k: int,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [T, k] fp32, expert ids [T, k] int64)
    """Softmax over all experts in fp32, the ``top_k`` largest; with ``normalize`` those
    renormalized to sum to 1 (Mixtral always, which equals a softmax over the top-k logits;
    Qwen3-MoE when ``norm_topk_prob``), as transformers' routers compute them."""
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[-1]}], got {top_k}")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class ExpertGroups:
    """A batch's (token, expert) pairs sorted by expert (module docstring)."""

    token_idx: torch.Tensor  # [S] int64, the token of each sorted row
    weights: torch.Tensor  # [S] fp32, the routing weight of each sorted row
    offsets: torch.Tensor  # [E + 1] int64, expert e's rows are [offsets[e], offsets[e + 1])
    num_tokens: int  # T


def group_by_expert(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort the pairs of ``route_topk``'s (weights, ids) [T, k] by expert; within an expert,
    by token (a stable sort), as transformers' per-expert loop visits them."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [S]
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = F.pad(counts.cumsum(0), (1, 0))
    return ExpertGroups(order // top_k, weights.reshape(-1).index_select(0, order).float(), offsets, num_tokens)


def combine(rows: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:  # [S, H] -> [T, H]
    """Each token's sum of its experts' outputs times their routing weights, added in
    expert order (transformers' order: the sums are bit-equal)."""
    out = torch.zeros(groups.num_tokens, rows.shape[1], dtype=rows.dtype, device=rows.device)
    return out.index_add_(0, groups.token_idx, rows * groups.weights[:, None].to(rows.dtype))


# ---- the experts ---------------------------------------------------------------------------
def expert_linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """The reference's ``x @ w.T`` for one expert's weight (float or quantized)."""
    return quantized_linear(x, w) if isinstance(w, QuantizedWeight) else F.linear(x, w)


def grouped_experts(
    x_sorted: torch.Tensor,  # [S, H], the rows of ExpertGroups (x[token_idx])
    offsets: torch.Tensor,  # [E + 1] int64
    experts: ExpertWeights,
    linear: ExpertLinear = expert_linear,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:  # [S, H]: each row through its expert's SwiGLU MLP, unweighted
    """One gate_up matmul, activation and down matmul per expert over its contiguous rows
    (``linear`` / ``act``: the dispatcher passes its own ops, the reference passes these)."""
    out = torch.empty(x_sorted.shape[0], experts.hidden_size, dtype=x_sorted.dtype, device=x_sorted.device)
    bounds = offsets.tolist()  # NOTE: one host sync per block, for E slice bounds
    for e in range(experts.num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        gate_up, down = experts.expert(e)
        out[lo:hi] = linear(act(linear(x_sorted[lo:hi], gate_up)), down)
    return out


def moe_experts(x: torch.Tensor, groups: ExpertGroups, experts: ExpertWeights) -> torch.Tensor:  # [T, H]
    """The experts' weighted sum for every token: the specification."""
    rows = grouped_experts(x.index_select(0, groups.token_idx), groups.offsets, experts)
    return combine(rows, groups)
