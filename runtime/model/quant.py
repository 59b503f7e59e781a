"""Quantized weights in the model: linear and embedding modules over
``kernels.QuantizedWeight``, and the swap that quantizes a loaded fp32 model.

Formats (``EngineConfig.weights``):

    "fp32"  the checkpoint's weights in the engine dtype (oneDNN-prepacked on the CPU)
    "int8"  int8 per output channel, symmetric, for every linear, the LM head and the
            embedding table (one shared copy when tied)
    "int4"  4-bit asymmetric, groups of 32 (Q4_1's arithmetic) for the decoder's linears;
            the LM head and embedding in int8 (as llama.cpp's Q4 files keep them in Q8_0:
            4 bits there cost far more quality than anywhere else)
    "gguf"  a GGUF model's own blocks (Q4_0, Q4_1, Q8_0), loaded without dequantizing
            (``runtime.model.gguf_weights``)

The quantized tensors are plain attributes, not parameters or buffers: ``Module.to`` would
cast the fp16 scales to the model dtype. Quantize after the model is on its device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

import kernels
from kernels import QuantizedWeight
from kernels.reference.quant import dequantize, quantize_int4, quantize_int8

if TYPE_CHECKING:  # NOTE: the decoder's MLP block module (mlp.py) builds QuantizedLinear from here
    from runtime.model.llama import DecoderLayer, LlamaForCausalLM


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` block-quantized (``kernels.quantized_linear``)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.in_features, self.out_features = weight.in_features, weight.out_features

    @classmethod
    def from_linear(cls, linear: nn.Module, quantize: type[QuantizedFormat]) -> QuantizedLinear:
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"expected an nn.Linear, got {type(linear).__name__}")
        return cls(quantize.linear(linear.weight.detach()), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.quantized_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        w = self.weight
        group = "row" if w.blocks_per_group is None else 32 * w.blocks_per_group
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={w.bits}, "
                f"group={group}, bias={self.bias is not None}")


class QuantizedBlock(nn.Module):
    """A block that holds quantized weights its own way rather than as ``QuantizedLinear``
    modules (a mixture of experts' stacked experts, ``runtime.model.moe``): the swaps of
    this module call these."""

    def quantize(self, linear: Callable[[torch.Tensor], QuantizedWeight]) -> None:
        """Quantize the block's float weights with ``linear`` (``QuantizedFormat.linear``)."""
        raise NotImplementedError

    def convert_quantized(self, convert: Callable[[QuantizedWeight], QuantizedWeight]) -> None:
        """Replace each quantized weight with ``convert(weight)`` (a move, the tiled layout)."""
        raise NotImplementedError

    @property
    def quantized_nbytes(self) -> int:
        raise NotImplementedError


class QuantizedEmbedding(nn.Module):
    """Token lookup in a quantized table: each looked-up row is dequantized."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] fp32
        return dequantize(self.weight.rows(input_ids))


class QuantizedFormat:
    """How ``quantize_model`` quantizes one kind of weight (fp32 [N, K] in, quantized out)."""

    @staticmethod
    def linear(weight: torch.Tensor) -> QuantizedWeight:
        raise NotImplementedError

    @staticmethod
    def embedding(weight: torch.Tensor) -> QuantizedWeight:
        return quantize_int8(weight)


class Int8(QuantizedFormat):
    @staticmethod
    def linear(weight: torch.Tensor) -> QuantizedWeight:
        return quantize_int8(weight)


class Int4(QuantizedFormat):
    @staticmethod
    def linear(weight: torch.Tensor) -> QuantizedWeight:
        return quantize_int4(weight, blocks_per_group=1)


FORMATS: dict[str, type[QuantizedFormat]] = {"int8": Int8, "int4": Int4}


def quantize_model(model: LlamaForCausalLM, fmt: str) -> None:
    """Swap every decoder linear, the LM head and the embedding table of a loaded fp32
    ``LlamaForCausalLM`` for quantized ones (``fmt``: "int8" or "int4"). Irreversible; the
    fp32 weights are released."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r} (use one of {sorted(FORMATS)})")
    quantize = FORMATS[fmt]
    for module in model.layers:
        layer = cast("DecoderLayer", module)
        attn = layer.self_attn
        attn.qkv_proj = QuantizedLinear.from_linear(attn.qkv_proj, quantize)
        attn.o_proj = QuantizedLinear.from_linear(attn.o_proj, quantize)
        if isinstance(layer.mlp, QuantizedBlock):  # e.g. experts stacked, quantized per row like a linear
            layer.mlp.quantize(quantize.linear)
            continue
        mlp = layer.dense_mlp(f"weights={fmt!r}")
        mlp.gate_up_proj = QuantizedLinear.from_linear(mlp.gate_up_proj, quantize)
        mlp.down_proj = QuantizedLinear.from_linear(mlp.down_proj, quantize)
    assert isinstance(model.embed_tokens, nn.Embedding), "already quantized"
    table = quantize.embedding(model.embed_tokens.weight.detach())
    model.embed_tokens = QuantizedEmbedding(table)
    head = model.lm_head
    assert head is None or isinstance(head, nn.Linear), "already prepacked or quantized"
    model.lm_head = QuantizedLinear(table if head is None else quantize.embedding(head.weight.detach()))


def quantized_nbytes(model: nn.Module) -> int:
    """Bytes held by the model's quantized weights (each shared table counted once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            seen[id(module.weight)] = module.weight.nbytes
        elif isinstance(module, QuantizedBlock):
            seen[id(module)] = module.quantized_nbytes
    return sum(seen.values())


def prepare_quantized(model: nn.Module) -> None:
    """Put the quantized weights in the layout the CPU kernel in use reads fastest
    (``kernels.prepare_quantized``: tiles of 16 rows on AVX-512 VNNI), once, after the
    native kernels are enabled; a shared table stays shared."""
    _swap_weights(model, kernels.prepare_quantized)


def move_quantized(model: nn.Module, device: torch.device) -> None:
    """Move the quantized weights (which ``Module.to`` does not see) to ``device``."""
    _swap_weights(model, lambda w: w.to(device))
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.bias is not None:
            module.bias = module.bias.to(device)


def _swap_weights(model: nn.Module, convert: Callable[[QuantizedWeight], QuantizedWeight]) -> None:
    """Replace each quantized module's weight with ``convert(weight)``, once per shared weight.

    NOTE: keyed by the old weight's id. An old weight freed once replaced cannot alias one
    still to be visited: both were alive together, so their ids differ; the old weights are
    not kept alive here, so at most one extra copy exists at a time."""
    done: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            key = id(module.weight)
            if key not in done:
                done[key] = convert(module.weight)
            module.weight = done[key]
        elif isinstance(module, QuantizedBlock):
            module.convert_quantized(convert)
