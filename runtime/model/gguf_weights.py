"""A GGUF model's weights loaded as they are stored: Q4_0 / Q4_1 / Q8_0 blocks become
``QuantizedWeight`` codes and scales bit for bit (``weights="gguf"``), with no fp32 copy.

What conversion (``convert.py``, through transformers) does to the numbers, we do to rows:
llama.cpp stores a Llama model's q and k projections with the rows of each head
interleaved for its rotary layout; undoing that is a row permutation, which moves whole
quantized rows. Tensors in other types (F32/F16 norms, or a linear in a K-quant we have
no kernel for) are dequantized with the ``gguf`` package; such a linear is then quantized
to int8 per channel, and the log says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels import QuantizedWeight
from kernels.reference.quant import (
    GGML_BLOCK_BYTES,
    cat_rows,
    dequantize,
    from_ggml_blocks,
    quantize_int8,
)
from runtime.errors import ModelLoadError
from runtime.model.llama import DecoderLayer, LlamaForCausalLM, ModelArgs, RMSNorm
from runtime.model.quant import QuantizedEmbedding, QuantizedLinear

log = logging.getLogger(__name__)


class GGUFTensors:
    """Name -> tensor of one GGUF file (memory-mapped by the ``gguf`` reader)."""

    def __init__(self, path: Path) -> None:
        import gguf

        try:
            self._reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # gguf raises ValueError, struct errors...
            raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}
        arch = self._reader.fields.get("general.architecture")
        self.architecture = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else ""
        self.path = path

    def _get(self, name: str) -> Any:
        if name not in self._tensors:
            raise ModelLoadError(f"tensor {name!r} missing from {self.path}")
        return self._tensors[name]

    def has(self, name: str) -> bool:
        return name in self._tensors

    def dense(self, name: str) -> torch.Tensor:  # [*shape] float32, dequantized if need be
        import gguf

        t = self._get(name)
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the file is mapped read-only

    def quantized(self, name: str) -> QuantizedWeight:
        """A 2-D weight ``[N, K]`` as ``QuantizedWeight`` (its own blocks where we have a
        kernel for them)."""
        t = self._get(name)
        kind = t.tensor_type.name
        in_features = int(t.shape[0])  # GGUF lists dims innermost first
        if kind in GGML_BLOCK_BYTES:
            raw = torch.from_numpy(np.array(t.data)).view(torch.uint8)  # a copy, as above
            return from_ggml_blocks(raw.reshape(int(t.shape[1]), -1), kind, in_features)
        log.info("GGUF tensor %s is %s: no kernel for it, quantizing to int8 per channel", name, kind)
        return quantize_int8(self.dense(name).reshape(-1, in_features))


def _unpermute_rows(num_heads: int, rows: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute)."""
    half = rows // num_heads // 2
    return torch.arange(rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(rows)


def load_gguf_model(path: Path, args: ModelArgs, max_positions: int) -> LlamaForCausalLM:
    """Build the model with every linear and the embedding table in the file's own
    quantized blocks and the norms in fp32 (CPU tensors)."""
    gg = GGUFTensors(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(args, max_positions)
    model.rope = type(model.rope)(args.head_dim, max_positions, args.rope)  # real buffers
    permute = gg.architecture == "llama"
    _set_norm(model.norm, gg.dense("output_norm.weight"))
    table = gg.quantized("token_embd.weight")
    model.embed_tokens = QuantizedEmbedding(table)
    model.lm_head = QuantizedLinear(gg.quantized("output.weight") if gg.has("output.weight") else table)
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        _load_layer(gg, f"blk.{i}.", layer, args, permute)
    return model.eval()


def _load_layer(gg: GGUFTensors, pre: str, layer: DecoderLayer, args: ModelArgs, permute: bool) -> None:
    q, k, v = (gg.quantized(pre + f"attn_{p}.weight") for p in "qkv")
    if permute:
        q = q.rows(_unpermute_rows(args.num_heads, q.out_features))
        k = k.rows(_unpermute_rows(args.num_kv_heads, k.out_features))
    bias = None
    if args.qkv_bias:
        bias = torch.cat([gg.dense(pre + f"attn_{p}.bias") for p in "qkv"])
    layer.self_attn.qkv_proj = QuantizedLinear(_fused(pre + "attn_qkv", [q, k, v]), bias)
    layer.self_attn.o_proj = QuantizedLinear(gg.quantized(pre + "attn_output.weight"))
    gate_up = _fused(pre + "ffn_gate_up", [gg.quantized(pre + f"ffn_{p}.weight") for p in ("gate", "up")])
    layer.mlp.gate_up_proj = QuantizedLinear(gate_up)
    layer.mlp.down_proj = QuantizedLinear(gg.quantized(pre + "ffn_down.weight"))
    _set_norm(layer.input_layernorm, gg.dense(pre + "attn_norm.weight"))
    _set_norm(layer.post_attention_layernorm, gg.dense(pre + "ffn_norm.weight"))


def _fused(name: str, parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts stacked into one weight; parts stored in different formats (a file may keep v
    in Q8_0 and q, k in Q4) are requantized together to int8 per channel."""
    formats = {(p.bits, p.blocks_per_group) for p in parts}
    if len(formats) == 1:
        return cat_rows(parts)
    log.info("GGUF %s: parts in different formats, quantizing the fused weight to int8", name)
    return quantize_int8(torch.cat([dequantize(p) for p in parts]))


def _set_norm(norm: RMSNorm, weight: torch.Tensor) -> None:
    norm.weight = torch.nn.Parameter(weight.reshape(-1), requires_grad=False)
