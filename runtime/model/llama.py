"""Llama-family decoder (Llama, Llama 3, SmolLM2, TinyLlama, Qwen2) over paged KV memory.

All tokens of a step are one flat ragged batch ``[T, hidden]``: prefill ("extend") tokens
of every request first, then one decode token per decoding request. Nothing is padded to
the longest request; only attention looks at per-request structure, through
``AttentionMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.onednn import PackedLinear
from runtime.model.attention import AttentionMetadata, paged_attention
from runtime.model.rope import RotaryEmbedding


@dataclass(frozen=True)
class ModelArgs:
    """The architecture numbers read from ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict[str, Any]
    qkv_bias: bool  # Qwen2: q/k/v projections carry a bias
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        arch = cfg.get("model_type", "llama")
        if arch not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported model_type {arch!r} (supported: llama, qwen2, mistral)")
        heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or {})
        if not rope:  # transformers 4.x layout
            rope = dict(cfg.get("rope_scaling") or {})
            rope["rope_theta"] = cfg.get("rope_theta", 10000.0)
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=rope,
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of ``residual + x``, ``residual + x``): the residual add before the norm,
        fused. ``residual`` is consumed (the CPU kernel updates it in place)."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        # NOTE: q, k and v projections are fused into one matmul (weights concatenated at load).
        self.qkv_proj: nn.Module = nn.Linear(args.hidden_size, q_size + 2 * kv_size, bias=args.qkv_bias)
        self.o_proj: nn.Module = nn.Linear(q_size, args.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split
        # q and k are adjacent in the fused output: rotate both heads' worth in place.
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : q_size + kv_size].view(num_tokens, heads, self.head_dim)
        kernels.apply_rotary(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, self.layer_idx, self.scale, meta)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up_proj: nn.Module = nn.Linear(args.hidden_size, 2 * self.inter, bias=False)  # fused
        self.down_proj: nn.Module = nn.Linear(self.inter, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden], the previous layer's output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, hidden], the residual stream before h; None at layer 0
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, the residual stream before it)
        """HF's ``h = h + attn(norm(h)); h = h + mlp(norm(h))``, with each residual add
        fused into the norm after it (the last one into the next layer's, or the final norm)."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        x, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(x, rope, meta), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head; ``forward`` returns logits only where asked."""

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.args = args
        # nn.Embedding, or runtime.model.quant.QuantizedEmbedding. NOTE: the model is built
        # on the meta device, then loaded; a given (empty) weight skips Embedding's random
        # init, whose meta path imports torch._dynamo and Triton (docs/memory.md).
        self.embed_tokens: nn.Module = nn.Embedding(
            args.vocab_size, args.hidden_size, _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rope = RotaryEmbedding(args.head_dim, max_positions, args.rope)
        self.lm_head: nn.Module | None = None if args.tie_word_embeddings else nn.Linear(
            args.hidden_size, args.vocab_size, bias=False
        )

    def prepack_linears(self) -> None:
        """Swap every linear (and the LM head) for a oneDNN-prepacked one (CPU, fp32).

        Irreversible: the plain weights are released, except the embedding table, which
        the token lookup still needs (a tied head gets its own packed copy).
        """
        assert isinstance(self.embed_tokens, nn.Embedding), "the weights are quantized"
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = PackedLinear.from_linear(attn.qkv_proj)
            attn.o_proj = PackedLinear.from_linear(attn.o_proj)
            mlp.gate_up_proj = PackedLinear.from_linear(mlp.gate_up_proj)
            mlp.down_proj = PackedLinear.from_linear(mlp.down_proj)
        self.lm_head = PackedLinear(self.embed_tokens.weight) if self.lm_head is None \
            else PackedLinear.from_linear(self.lm_head)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        logits_idx: torch.Tensor,  # [N] int64, rows of T that need logits
    ) -> torch.Tensor:  # [N, vocab] float32
        h = self.embed_tokens(input_ids)
        rope = self.rope.lookup(positions)  # the same for every layer
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, meta)
        assert residual is not None, "a model has at least one layer"
        h, _ = self.norm.add_and_norm(h.index_select(0, logits_idx), residual.index_select(0, logits_idx))
        if self.lm_head is None:  # tied, not prepacked nor quantized
            assert isinstance(self.embed_tokens, nn.Embedding)
            return F.linear(h, self.embed_tokens.weight).float()
        return self.lm_head(h).float()
