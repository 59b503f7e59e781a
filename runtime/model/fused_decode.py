"""Decode-only steps of a model with block-quantized weights as one native call.

On the CPU, a batch-1 decode step of the default model spent more time between the
matmuls (Python, dispatch, OpenMP fork/join, ~12 kernels a layer) than in them
(docs/benchmarks.md#fused_decode_motivation). The fused step
(``kernels/cpu/decode_step.c``) runs the whole forward pass in one OpenMP region with the
same arithmetic; the layer-by-layer model stays the reference, the path for every batch
that prefills or verifies, and the path for models the step does not take.

The step has only the quantized kernel; where the layer-by-layer linears leave it for a
dequantized matmul above some batch size (``kernels.quant_kernel_max_rows``: for weights in
the row layout, a bf16 matmul from 32 or 64 rows with AVX512_BF16; tiled weights never
leave it), the step takes batches up to that size (``max_batch``) and larger decode
batches run layer by layer, so the two paths always compute the same bits, and a large
batch gets the faster matmul.
"""

from __future__ import annotations

import torch

import kernels
from kernels import (
    DecodeExperts,
    DecodeLayerWeights,
    DecodeModelWeights,
    DecodePool,
    UnsupportedDecodeModel,
)
from kernels.cpu.decode_step import BoundDecodeStep
from kernels.reference.quant import QuantizedWeight
from runtime.model.kv_cache import KVCache
from runtime.model.llama import DecoderLayer, LlamaForCausalLM
from runtime.model.mlp import mlp_block
from runtime.model.moe import SparseMoeBlock
from runtime.model.quant import QuantizedLinear


def _quantized(module: object, name: str) -> QuantizedLinear:
    if not isinstance(module, QuantizedLinear):
        raise UnsupportedDecodeModel(f"{name} is {type(module).__name__}, not a quantized linear")
    return module


def decode_weights(model: LlamaForCausalLM) -> DecodeModelWeights:
    """The model's weights as the fused step reads them (no copies). Raises
    ``UnsupportedDecodeModel`` for a model whose linears are not all block-quantized."""
    args = model.args
    if "fused_decode" not in mlp_block(args.mlp).supports:
        raise UnsupportedDecodeModel(f"the {args.mlp!r} MLP block")
    # NOTE: sliding windows, the attention scale and soft-cap run in the step; the
    # embedding scale and the logits' soft-cap in ``FusedDecode.forward``, as the layers do
    differs = {"a non-SiLU MLP": args.hidden_act != "silu",
               "partial rotary": args.rotary_dim != args.head_dim,
               "Gemma's sandwich norms and local rope": args.sandwich_norms or args.local_rope is not None}
    if any(differs.values()):
        raise UnsupportedDecodeModel(f"the {args.family} family ({', '.join(k for k, v in differs.items() if v)}: "
                                     "the step has none of them)")
    layers = []
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        qkv = _quantized(attn.qkv_proj, f"layers[{i}].qkv_proj")
        gate_up, down, experts = _mlp_weights(layer, i)
        qk_norms = None if attn.q_norm is None or attn.k_norm is None else (
            attn.q_norm.weight.detach(), attn.k_norm.weight.detach())
        layers.append(DecodeLayerWeights(
            qkv.weight, qkv.bias, _quantized(attn.o_proj, f"layers[{i}].o_proj").weight, gate_up, down,
            layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
            attn.window, experts, qk_norms,
        ))
    head = _quantized(model.lm_head, "lm_head")
    if head.bias is not None:
        raise UnsupportedDecodeModel("an LM head with a bias")
    return DecodeModelWeights(tuple(layers), model.norm.weight.detach(), head.weight, args.num_heads,
                              args.num_kv_heads, args.head_dim, args.rms_norm_eps, args.attn_scale,
                              args.attn_softcap)


def _mlp_weights(layer: DecoderLayer, i: int) -> tuple[QuantizedWeight, QuantizedWeight, DecodeExperts | None]:
    """The layer's (gate_up, down, router): a dense MLP's, or a mixture of experts' stacked
    experts (quantized) and router."""
    if isinstance(layer.mlp, SparseMoeBlock):
        block = layer.mlp
        ex = block.quantized
        if ex is None or not isinstance(ex.gate_up, QuantizedWeight) or not isinstance(ex.down, QuantizedWeight):
            raise UnsupportedDecodeModel(f"layers[{i}]'s experts are not quantized")
        router = block.gate.weight.detach()
        return ex.gate_up, ex.down, DecodeExperts(router, block.args.top_k, block.args.normalize_topk)
    try:
        mlp = layer.dense_mlp("the fused decode step")
    except NotImplementedError as exc:
        raise UnsupportedDecodeModel(str(exc)) from exc
    return (_quantized(mlp.gate_up_proj, f"layers[{i}].gate_up_proj").weight,
            _quantized(mlp.down_proj, f"layers[{i}].down_proj").weight, None)


def decode_pool(kv: KVCache) -> DecodePool:
    return DecodePool(tuple(kv.k), tuple(kv.v), None if kv.k_scale is None else tuple(kv.k_scale),
                      None if kv.v_scale is None else tuple(kv.v_scale), kv.page_size)


class FusedDecode:
    """The fused step bound to one model and its KV pool."""

    def __init__(self, model: LlamaForCausalLM, step: BoundDecodeStep, max_batch: int | None = None) -> None:
        self.model, self.step = model, step
        self.max_batch = max_batch  # larger decode batches take the layer-by-layer path (None: none)

    def takes(self, batch_size: int) -> bool:
        return self.max_batch is None or batch_size <= self.max_batch

    @classmethod
    def build(cls, model: LlamaForCausalLM, kv: KVCache, device: torch.device) -> FusedDecode:
        """Raises ``UnsupportedDecodeModel`` naming why the model or device does not fit
        (not the CPU, weights not block-quantized, native kernels not built...)."""
        if device.type != "cpu":
            raise UnsupportedDecodeModel(f"the fused decode step runs on the CPU, not {device}")
        weights = decode_weights(model)
        step = kernels.bind_decode_step(weights, decode_pool(kv))
        every = [w for layer in weights.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        limits = [n for n in map(kernels.quant_kernel_max_rows, [*every, weights.lm_head]) if n is not None]
        if any(layer.experts is not None for layer in weights.layers):
            # NOTE: the step's experts block matches the layer-by-layer path within the
            # router's rounding at one request; at several, logits were seen to differ by
            # ~1e-2 (not yet understood), so larger batches keep the layer-by-layer path
            limits.append(1)
        return cls(model, step, min(limits, default=None))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B] int64, one new token per request
        positions: torch.Tensor,  # [B] int64
        slots: torch.Tensor,  # [B] int64 pool slot of each new token
        page_table: torch.Tensor,  # [B, max_pages] int32
        seq_lens: torch.Tensor,  # [B] int32, cached tokens incl. the new one
    ) -> torch.Tensor:  # [B, vocab] fp32
        args = self.model.args
        h = self.model.embed_tokens(input_ids).contiguous()  # NOTE: a fresh tensor; the step overwrites it
        if args.embed_scale is not None:  # NOTE: the layer-by-layer path's very operation
            h = (h * torch.tensor(args.embed_scale, dtype=h.dtype)).contiguous()
        cos, sin = self.model.rope.lookup(positions)
        logits = self.step(h, cos.squeeze(1), sin.squeeze(1), slots, page_table, seq_lens)
        cap = args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
