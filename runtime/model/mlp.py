"""The feed-forward block of a decoder layer, and the hook that lets a family replace it.

Every family runs the same decoder (``llama.py``); what sits where the MLP is differs: a
gated MLP (SwiGLU, or GeGLU for Gemma) or a mixture of experts. ``MLPBlock`` is that hook:
it builds the module and maps the checkpoint's tensors (HF names, GGUF names) onto it.
A family names its block in ``Family.mlp``; ``ModelArgs.mlp`` carries the name to the
layer, which builds ``mlp_block(args.mlp).build(args)``.

Our module names below ``layers.N.mlp.``: the dense block holds ``gate_up_proj`` (gate and
up fused, gate first) and ``down_proj``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

import kernels
from kernels import QuantizedWeight

if TYPE_CHECKING:
    from runtime.model.gguf_weights import GGUFTensors
    from runtime.model.llama import ModelArgs

Take = Callable[[str], torch.Tensor]  # an HF checkpoint tensor by name (fp32), or ModelLoadError

# NOTE: a long prefill's gate / up output is the largest transient of a step (rows x 2 x
# intermediate fp32, a quarter of a 1B model's weights at 2,048 rows, and resident while it
# lives), so the rows pass the MLP in chunks of this many: each chunk reads the weights once
# more, which the chunk's compute dwarfs at this size (docs/memory.md).
MLP_CHUNK_ROWS = 512


class MLP(nn.Module):
    """The gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up as one matmul."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inter = args.intermediate_size
        self.act = args.hidden_act
        self.gate_up_proj: nn.Module = nn.Linear(args.hidden_size, 2 * self.inter, bias=False)  # fused
        self.down_proj: nn.Module = nn.Linear(self.inter, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if x.shape[0] <= MLP_CHUNK_ROWS:
            return self._forward(x)
        return torch.cat([self._forward(rows) for rows in x.split(MLP_CHUNK_ROWS)])

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "silu":
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(ACTIVATIONS[self.act](gate) * up)


# The gate activations a gated MLP runs (HF's ``hidden_act`` / ``hidden_activation`` names).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu": nn.functional.gelu,
}


class MLPBlock:
    """What a family's feed-forward block is: how to build it and where its weights are.

    Subclass and register (``register_mlp``) to replace the dense MLP, e.g. with experts.
    Every method sees ``dst`` = ``"layers.N.mlp."`` (our names) and the source prefix.
    """

    name = "dense"
    # What the engine may do with this block (``engine_setup.check_family_support`` refuses
    # the rest with an error naming the combination): "int8" / "int4" (quantize_model),
    # "tensor_parallel" (parallel.shard_model), "fused_decode" (the native decode step).
    supports: frozenset[str] = frozenset({"int8", "int4", "tensor_parallel", "fused_decode"})

    def build(self, args: ModelArgs, layer_idx: int = 0) -> nn.Module:
        """The module of layer ``layer_idx`` (a family may mix blocks across layers)."""
        return MLP(args)

    def hf_state(self, take: Take, src: str, dst: str, args: ModelArgs) -> dict[str, torch.Tensor]:
        """Our fp32 state of the block from an HF checkpoint (``src`` = ``"model.layers.N.mlp."``)."""
        return {dst + "gate_up_proj.weight": torch.cat([take(src + "gate_proj.weight"), take(src + "up_proj.weight")]),
                dst + "down_proj.weight": take(src + "down_proj.weight")}

    def gguf_shapes(self, cfg: dict[str, int], pre: str) -> dict[str, tuple[int, ...]]:
        """The GGUF tensors the block reads (``pre`` = ``"blk.N."``), GGUF order (innermost first)."""
        hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
        return {pre + "ffn_gate.weight": (hidden, ffn), pre + "ffn_up.weight": (hidden, ffn),
                pre + "ffn_down.weight": (ffn, hidden)}

    def gguf_state(self, gg: GGUFTensors, pre: str, dst: str, args: ModelArgs) -> dict[str, torch.Tensor]:
        """Our fp32 state of the block from a GGUF file (dequantized tensor by tensor)."""
        return {dst + "gate_up_proj.weight": torch.cat([gg.dense(pre + f"ffn_{p}.weight") for p in ("gate", "up")]),
                dst + "down_proj.weight": gg.dense(pre + "ffn_down.weight")}

    def gguf_native(self, gg: GGUFTensors, pre: str, args: ModelArgs) -> dict[str, QuantizedWeight | torch.Tensor]:
        """The block's weights in the file's own blocks, by module name below ``dst``
        (each becomes a ``QuantizedLinear`` there, see ``load_native``)."""
        return {"gate_up_proj": gg.stacked([pre + f"ffn_{p}.weight" for p in ("gate", "up")]),
                "down_proj": gg.stacked([pre + "ffn_down.weight"])}

    def load_native(self, module: nn.Module, weights: dict[str, QuantizedWeight | torch.Tensor]) -> None:
        """Put ``gguf_native``'s weights into the built (meta) ``module``."""
        from runtime.model.quant import QuantizedLinear

        for name, weight in weights.items():
            assert isinstance(weight, QuantizedWeight), f"{name}: the dense MLP's weights are all quantized"
            setattr(module, name, QuantizedLinear(weight))


class FusedGateUp(MLPBlock):
    """The dense MLP stored with gate and up as one weight (Phi-3: ``gate_up_proj``, GGUF
    ``ffn_up`` of twice the rows, gate first), as we hold it."""

    name = "dense_fused"

    def hf_state(self, take: Take, src: str, dst: str, args: ModelArgs) -> dict[str, torch.Tensor]:
        return {dst + "gate_up_proj.weight": take(src + "gate_up_proj.weight"),
                dst + "down_proj.weight": take(src + "down_proj.weight")}

    def gguf_shapes(self, cfg: dict[str, int], pre: str) -> dict[str, tuple[int, ...]]:
        hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
        return {pre + "ffn_up.weight": (hidden, 2 * ffn), pre + "ffn_down.weight": (ffn, hidden)}

    def gguf_state(self, gg: GGUFTensors, pre: str, dst: str, args: ModelArgs) -> dict[str, torch.Tensor]:
        return {dst + "gate_up_proj.weight": gg.dense(pre + "ffn_up.weight"),
                dst + "down_proj.weight": gg.dense(pre + "ffn_down.weight")}

    def gguf_native(self, gg: GGUFTensors, pre: str, args: ModelArgs) -> dict[str, QuantizedWeight | torch.Tensor]:
        return {"gate_up_proj": gg.stacked([pre + "ffn_up.weight"]), "down_proj": gg.stacked([pre + "ffn_down.weight"])}


MLP_BLOCKS: dict[str, MLPBlock] = {}


def register_mlp(block: MLPBlock) -> MLPBlock:
    MLP_BLOCKS[block.name] = block
    return block


def mlp_block(name: str) -> MLPBlock:
    if name not in MLP_BLOCKS:
        raise ValueError(f"unknown MLP block {name!r} (registered: {', '.join(sorted(MLP_BLOCKS))})")
    return MLP_BLOCKS[name]


DENSE = register_mlp(MLPBlock())
DENSE_FUSED = register_mlp(FusedGateUp())
