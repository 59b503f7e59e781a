"""The mixture-of-experts block (Qwen3-MoE, Mixtral): a router picks ``top_k`` of
``num_experts`` SwiGLU experts per token, and the experts run grouped per expert
(``kernels.moe_experts``: rows sorted by expert, one matmul per expert, never a loop over
tokens).

What differs between the two families is only the router's normalisation and which layers
have experts (``MoEArgs``); the experts' arithmetic is shared. Expert weights live stacked,
``gate_up_proj [E, 2I, H]`` (gate rows then up rows, as the dense MLP fuses them) and
``down_proj [E, H, I]``, as transformers 5 holds them; ``quantize`` swaps them for one
``QuantizedWeight`` of E * 2I (E * H) rows each, quantized per row like the dense linears.
The router stays fp32: it is E x H, and a flipped top-k choice is a different model.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import kernels
from kernels import ExpertWeights, QuantizedWeight
from kernels.reference.quant import TILE_ROWS, untile
from runtime.errors import ModelLoadError
from runtime.model.mlp import DENSE, MLP, MLPBlock, Take, register_mlp
from runtime.model.quant import QuantizedBlock

if TYPE_CHECKING:
    from runtime.model.gguf_weights import GGUFTensors
    from runtime.model.llama import ModelArgs

HF_MOE_TYPES = ("qwen3_moe", "mixtral")


@dataclass(frozen=True)
class MoEArgs:
    """The expert numbers read from ``config.json`` (or a GGUF file's metadata)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    normalize_topk: bool  # renormalize the top-k probabilities (Mixtral always; Qwen3-MoE's norm_topk_prob)
    sparse_step: int = 1  # Qwen3-MoE's decoder_sparse_step: layer i has experts iff (i + 1) % step == 0
    dense_layers: tuple[int, ...] = ()  # Qwen3-MoE's mlp_only_layers: a dense MLP there

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.intermediate_size < 1 or self.sparse_step < 1:
            raise ValueError("the experts' intermediate size and decoder_sparse_step must be positive")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MoEArgs:
        """Qwen3-MoE's or Mixtral's expert settings.

        Raises:
            ValueError: another model_type, or a setting we do not implement (a hidden_act
                other than silu, shared experts).
        """
        arch = cfg.get("model_type")
        if arch not in HF_MOE_TYPES:
            raise ValueError(f"not a mixture-of-experts model_type we run: {arch!r} (supported: {HF_MOE_TYPES})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{arch} with hidden_act {cfg['hidden_act']!r}: the experts implement silu only")
        if cfg.get("shared_expert_intermediate_size"):
            raise ValueError(f"{arch} with shared experts is not supported")
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if arch == "mixtral":
            return cls(num_experts, int(cfg.get("num_experts_per_tok", 2)), int(cfg["intermediate_size"]), True)
        return cls(num_experts, int(cfg.get("num_experts_per_tok", 8)), int(cfg["moe_intermediate_size"]),
                   bool(cfg.get("norm_topk_prob", False)), int(cfg.get("decoder_sparse_step", 1)),
                   tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))

    def has_experts(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has an experts block (else a dense MLP)."""
        return layer_idx not in self.dense_layers and (layer_idx + 1) % self.sparse_step == 0


def moe_options(cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture-of-experts family's extra ``ModelArgs`` (``Family.options``)."""
    return {"moe": MoEArgs.from_hf_config(cfg)}


class SparseMoeBlock(QuantizedBlock):
    """Router + experts; ``forward`` maps ``[T, hidden]`` to ``[T, hidden]``."""

    def __init__(self, hidden_size: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        e, inter = args.num_experts, args.intermediate_size
        self.gate = nn.Linear(hidden_size, e, bias=False)  # the router
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, inter))
        # NOTE: a plain attribute (as QuantizedLinear's weight): Module.to must not cast it
        self.quantized: ExpertWeights | None = None

    def experts(self) -> ExpertWeights:
        """The experts' weights as the kernels take them."""
        if self.quantized is not None:
            return self.quantized
        return ExpertWeights(self.gate_up_proj, self.down_proj, self.args.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        logits = self.gate(x)  # [T, E]
        weights, ids = kernels.route_topk(logits, self.args.top_k, self.args.normalize_topk)
        groups = kernels.group_by_expert(weights, ids, self.args.num_experts)
        return kernels.moe_experts(x, groups, self.experts()).to(x.dtype)

    def quantize(self, linear: Callable[[torch.Tensor], QuantizedWeight]) -> None:
        """Swap the experts for quantized ones (``linear``: fp32 [N, K] in, as
        ``QuantizedFormat.linear``). Irreversible; the float weights are released."""
        gate_up, down = (w.detach().float().reshape(-1, w.shape[2]) for w in (self.gate_up_proj, self.down_proj))
        self.set_quantized(linear(gate_up), linear(down))

    def set_quantized(self, gate_up: QuantizedWeight, down: QuantizedWeight) -> None:
        """Hold already quantized experts (stacked, module docstring): a GGUF file's blocks."""
        self.quantized = ExpertWeights(gate_up, down, self.args.num_experts)
        self.gate_up_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0), requires_grad=False)

    def convert_quantized(self, convert: Callable[[QuantizedWeight], QuantizedWeight]) -> None:
        """Replace each quantized expert weight with ``convert(weight)`` (a move, the tiled
        layout); a tiled result is kept only where each expert has whole tiles."""
        if self.quantized is None:
            return
        ex = self.quantized
        parts = []
        for w in (ex.gate_up, ex.down):
            assert isinstance(w, QuantizedWeight)
            new = convert(w)
            parts.append(new if not new.tiled or (w.out_features // ex.num_experts) % TILE_ROWS == 0 else w)
        self.quantized = ExpertWeights(parts[0], parts[1], ex.num_experts)

    @property
    def quantized_nbytes(self) -> int:
        if self.quantized is None:
            return 0
        return sum(w.nbytes for w in (self.quantized.gate_up, self.quantized.down) if isinstance(w, QuantizedWeight))


def hf_experts_state(
    take: Callable[[str], torch.Tensor], has: Callable[[str], bool], src: str, num_experts: int
) -> dict[str, torch.Tensor]:
    """One layer's experts block in our names (``gate.weight``, ``gate_up_proj``,
    ``down_proj``) from an HF checkpoint's, ``src`` the block's prefix (``model.layers.3.mlp.``
    or Mixtral's ``...block_sparse_moe.``). Checkpoints store experts one by one
    (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``; Mixtral's ``w1`` / ``w3`` /
    ``w2``) or stacked as transformers 5 holds them (``experts.gate_up_proj``)."""
    out = {"gate.weight": take(src + "gate.weight")}
    if has(src + "experts.gate_up_proj"):
        out["gate_up_proj"], out["down_proj"] = take(src + "experts.gate_up_proj"), take(src + "experts.down_proj")
        return out
    names = ("w1", "w3", "w2") if has(src + "experts.0.w1.weight") else ("gate_proj", "up_proj", "down_proj")
    gate, up, down = ([take(f"{src}experts.{e}.{n}.weight") for e in range(num_experts)] for n in names)
    out["gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
    out["down_proj"] = torch.stack(down)
    return out


# ---- GGUF ------------------------------------------------------------------------------------
# llama.cpp's names for one layer's experts block (``pre`` = "blk.N."): the router, and each
# projection of every expert as one 3-D tensor (GGUF shape innermost first: [K, N, E]).
GGUF_ROUTER, GGUF_EXPERTS = "ffn_gate_inp.weight", ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def gguf_moe_config(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The config.json keys of a GGUF file's experts (empty when it has none): llama.cpp
    writes ``{arch}.expert_count`` / ``expert_used_count`` (and Qwen3-MoE's
    ``expert_feed_forward_length``); Mixtral comes as ``general.architecture = llama``
    with experts. llama.cpp renormalizes the top-k weights of both unless
    ``{arch}.expert_weights_norm`` says otherwise."""
    count = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if count == 0:
        return {}
    used, norm = int(meta[f"{arch}.expert_used_count"]), bool(meta.get(f"{arch}.expert_weights_norm", True))
    if arch == "llama":
        return {"model_type": "mixtral", "num_local_experts": count, "num_experts_per_tok": used}
    return {"num_experts": count, "num_experts_per_tok": used, "norm_topk_prob": norm,
            "moe_intermediate_size": int(meta[f"{arch}.expert_feed_forward_length"])}


def gguf_experts_shapes(pre: str, hidden: int, args: MoEArgs) -> dict[str, tuple[int, ...]]:
    """The GGUF tensors of one layer's experts block, GGUF order (innermost first)."""
    e, inter = args.num_experts, args.intermediate_size
    gate, up, down = GGUF_EXPERTS
    return {pre + GGUF_ROUTER: (hidden, e), pre + gate: (hidden, inter, e), pre + up: (hidden, inter, e),
            pre + down: (inter, hidden, e)}


def gguf_experts_state(dense: Callable[[str], torch.Tensor], pre: str) -> dict[str, torch.Tensor]:
    """One layer's experts block in our names, dequantized (``dense``: a GGUF tensor in
    torch order, fp32)."""
    gate, up, down = (dense(pre + name) for name in GGUF_EXPERTS)  # [E, I, H], [E, I, H], [E, H, I]
    return {"gate.weight": dense(pre + GGUF_ROUTER), "gate_up_proj": torch.cat([gate, up], dim=1), "down_proj": down}


def interleave_gate_up(stacked: QuantizedWeight, num_experts: int) -> QuantizedWeight:
    """All experts' gate rows then all their up rows -> expert by expert [gate | up] (the
    order the experts kernels read), in the row layout."""
    inter = stacked.out_features // (2 * num_experts)
    rows = torch.arange(2 * num_experts * inter).view(2, num_experts, inter).transpose(0, 1).reshape(-1)
    return stacked.rows(rows)


# ---- the family hook ---------------------------------------------------------------------------
def _layer_idx(prefix: str) -> int:
    """The layer of a checkpoint prefix ("model.layers.3.mlp.", "blk.3."): the MLPBlock hooks
    other than ``build`` see only the prefix."""
    found = re.search(r"(\d+)\.(?:mlp\.)?$", prefix)
    if found is None:
        raise ValueError(f"no layer index in the prefix {prefix!r}")
    return int(found.group(1))


def _moe(args: ModelArgs) -> MoEArgs:
    if args.moe is None:
        raise ValueError(f"the {args.family} family's experts block needs ModelArgs.moe")
    return args.moe


def _present(take: Take, name: str) -> bool:
    try:
        take(name)
    except ModelLoadError:
        return False
    return True


class ExpertsBlock(MLPBlock):
    """A mixture of experts where the MLP is (``SparseMoeBlock``), the dense MLP in the
    layers without experts (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``).
    int8 / int4 quantize the experts, which the fused decode step runs too (its C layer's
    experts block); tensor parallelism is refused by the engine, naming this block."""

    name = "experts"
    supports = frozenset({"int8", "int4", "fused_decode"})

    def build(self, args: ModelArgs, layer_idx: int = 0) -> nn.Module:
        moe = _moe(args)
        return SparseMoeBlock(args.hidden_size, moe) if moe.has_experts(layer_idx) else MLP(args)

    def hf_state(self, take: Take, src: str, dst: str, args: ModelArgs) -> dict[str, torch.Tensor]:
        moe = _moe(args)
        if not moe.has_experts(_layer_idx(src)):
            return DENSE.hf_state(take, src, dst, args)
        if args.family == "mixtral":  # HF Mixtral checkpoints: model.layers.N.block_sparse_moe.
            src = src.removesuffix("mlp.") + "block_sparse_moe."
        state = hf_experts_state(take, lambda name: _present(take, name), src, moe.num_experts)
        return {dst + name: t for name, t in state.items()}

    def gguf_shapes(self, cfg: dict[str, int], pre: str) -> dict[str, tuple[int, ...]]:
        moe = MoEArgs.from_hf_config(cfg)
        if not moe.has_experts(_layer_idx(pre)):
            return DENSE.gguf_shapes(cfg, pre)
        return gguf_experts_shapes(pre, cfg["hidden_size"], moe)

    def gguf_state(self, gg: GGUFTensors, pre: str, dst: str, args: ModelArgs) -> dict[str, torch.Tensor]:
        if not _moe(args).has_experts(_layer_idx(pre)):
            return DENSE.gguf_state(gg, pre, dst, args)
        return {dst + name: t for name, t in gguf_experts_state(gg.dense, pre).items()}

    def gguf_native(self, gg: GGUFTensors, pre: str, args: ModelArgs) -> dict[str, QuantizedWeight | torch.Tensor]:
        """The experts in the file's own blocks (row layout: ``prepare_quantized`` tiles
        them where each expert has whole tiles), the router dequantized to fp32."""
        moe = _moe(args)
        if not moe.has_experts(_layer_idx(pre)):
            return DENSE.gguf_native(gg, pre, args)
        gate, up, down = (pre + name for name in GGUF_EXPERTS)
        return {"gate.weight": gg.dense(pre + GGUF_ROUTER),
                "gate_up_proj": interleave_gate_up(gg.stacked([gate, up]), moe.num_experts),
                "down_proj": untile(gg.stacked([down]))}

    def load_native(self, module: nn.Module, weights: dict[str, QuantizedWeight | torch.Tensor]) -> None:
        if not isinstance(module, SparseMoeBlock):
            return DENSE.load_native(module, weights)
        router, gate_up, down = weights["gate.weight"], weights["gate_up_proj"], weights["down_proj"]
        assert isinstance(router, torch.Tensor) and isinstance(gate_up, QuantizedWeight)
        assert isinstance(down, QuantizedWeight)
        module.gate.weight = nn.Parameter(router.float(), requires_grad=False)
        module.set_quantized(gate_up, down)
        return None


EXPERTS = register_mlp(ExpertsBlock())
