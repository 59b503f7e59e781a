"""The decoder every model family shares, over paged KV memory.

A family (``runtime/model/families/``) states what differs: q/k/v bias, q/k norms, the
rotary variant, sliding windows per layer, the MLP block (``runtime.model.mlp``); the
stack below reads those from ``ModelArgs`` and shares everything else.

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
from runtime.model.families import family_for_config
from runtime.model.mlp import ACTIVATIONS, MLP, mlp_block
from runtime.model.moe import MoEArgs
from runtime.model.rope import RotaryEmbedding, rope_inv_freq, rope_type

__all__ = ["MLP", "Attention", "DecoderLayer", "LlamaForCausalLM", "ModelArgs", "RMSNorm"]


@dataclass(frozen=True)
class ModelArgs:
    """The architecture numbers read from ``config.json`` (through the model's family)."""

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
    family: str = "llama"  # the ``runtime.model.families`` name
    qk_norm: bool = False  # Qwen 3: RMSNorm over each q and k head before the rotary
    # Per layer: attend to the last W positions only (None: every position); () = none anywhere
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate activation
    mlp: str = "dense"  # the feed-forward block (``runtime.model.mlp``)
    # Gemma's differences (None / False: as Llama)
    local_rope: dict[str, Any] | None = None  # the rope of the sliding-window layers, when theirs differs
    embed_scale: float | None = None  # the embeddings multiplied by this (sqrt(hidden))
    attn_scale: float | None = None  # the attention scale (default head_dim ** -0.5)
    attn_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    sandwich_norms: bool = False  # each block's output is normed too, before its residual add

    moe: MoEArgs | None = None  # the experts of a mixture-of-experts family (``runtime.model.moe``)

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each q / k head that rotate (Phi-4-mini: 3/4 of them)."""
        return int(self.head_dim * float(self.rope.get("partial_rotary_factor", 1.0)))

    def window(self, layer_idx: int) -> int | None:
        return self.layer_windows[layer_idx] if self.layer_windows else None

    @property
    def kv_window(self) -> int | None:
        """The window that bounds every layer's attention (Mistral), so K/V further back
        than it is never read again; None when some layer sees the whole sequence (Gemma's
        global layers, or no windows at all)."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(w for w in self.layer_windows if w is not None)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Raises ``ValueError`` naming what we cannot run: an unknown model_type, rope
        type, activation or layer type."""
        family = family_for_config(cfg)
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        rope = dict(cfg.get("rope_parameters") or {})
        local_rope = None
        if "full_attention" in rope:  # transformers 5: one rope per layer type (Gemma 3)
            local_rope = dict(rope.get("sliding_attention") or rope["full_attention"])
            rope = dict(rope["full_attention"])
            rope_inv_freq(head_dim, local_rope)
        if not rope:  # transformers 4.x layout
            rope = dict(cfg.get("rope_scaling") or {})
            rope["rope_theta"] = cfg.get("rope_theta", 10000.0)
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        if rope_type(rope) in ("yarn", "longrope", "dynamic"):  # their scale reads the context lengths
            rope.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
            rope.setdefault("original_max_position_embeddings",
                            cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings"))
        # NOTE: checks the rope type (and its factors' length) before anything is built
        rope_inv_freq(int(head_dim * float(rope.get("partial_rotary_factor", 1.0))), rope)
        act = str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu")
        if act not in family.activations or act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} for a {family.name} model "
                             f"(supported: {', '.join(family.activations)})")
        num_layers = int(cfg["num_hidden_layers"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=rope,
            qkv_bias=family.qkv_bias or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            family=family.name,
            qk_norm=family.qk_norm,
            layer_windows=_layer_windows(cfg, num_layers, family.sliding_window),
            hidden_act=act,
            mlp=family.mlp,
            local_rope=None if local_rope == rope else local_rope,
            sandwich_norms=family.sandwich_norms,
            **family.options(cfg),
        )


def _layer_windows(cfg: dict[str, Any], num_layers: int, windowed: bool) -> tuple[int | None, ...]:
    """Each layer's attention window: ``layer_types`` where the config lists them (HF 5),
    else every layer's ``sliding_window`` for a windowed family; () when no layer has one."""
    window = cfg.get("sliding_window")
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if windowed and window else "full_attention"] * num_layers
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types lists {len(kinds)} layers, the model has {num_layers}")
    unknown = set(kinds) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unsupported layer type(s) {sorted(unknown)}")
    if "sliding_attention" in kinds and not window:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    windows = tuple(int(window or 0) if k == "sliding_attention" else None for k in kinds)
    return windows if any(w is not None for w in windows) else ()


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
        self.scale = self.head_dim**-0.5 if args.attn_scale is None else args.attn_scale
        self.softcap = args.attn_softcap
        self.window = args.window(layer_idx)
        self.rotary_dim = args.rotary_dim
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split
        # q and k are adjacent in the fused output: rotate both heads' worth in place.
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : q_size + kv_size].view(num_tokens, heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # NOTE: a new [T, Hq + Hkv, D] tensor
            d = self.head_dim
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads].reshape(-1, d)).view(num_tokens, -1, d),
                            self.k_norm(qk[:, self.num_heads :].reshape(-1, d)).view(num_tokens, -1, d)], dim=1)
        kernels.apply_rotary(qk if self.rotary_dim == self.head_dim else qk[..., : self.rotary_dim], *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, self.layer_idx, self.scale, meta, self.window, self.softcap)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = mlp_block(args.mlp).build(args, layer_idx)
        # Gemma's sandwich: the attention's and the MLP's outputs normed before their residual adds
        self.attn_output_norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if args.sandwich_norms else None
        self.mlp_output_norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if args.sandwich_norms else None

    def dense_mlp(self, what: str) -> MLP:
        """The layer's MLP, when it is the dense one; ``what`` needs it to be.

        Raises:
            NotImplementedError: another block (experts) stands there, naming it and ``what``.
        """
        if not isinstance(self.mlp, MLP):
            raise NotImplementedError(f"{what} is not supported with the {type(self.mlp).__name__} MLP block")
        return self.mlp

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
        if self.attn_output_norm is None or self.mlp_output_norm is None:
            x, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(x, rope, meta), residual)
            return self.mlp(x), residual
        attn = self.attn_output_norm(self.self_attn(x, rope, meta))
        x, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.mlp_output_norm(self.mlp(x)), residual


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
        self.rope = RotaryEmbedding(args.rotary_dim, max_positions, args.rope)
        self.local_rope = None if args.local_rope is None else RotaryEmbedding(args.rotary_dim, max_positions,
                                                                                args.local_rope)
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
            if isinstance(mlp, MLP):  # NOTE: another block (experts) keeps its own layout
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
        h = self.hidden_states(input_ids, positions, meta, logits_idx)
        if self.lm_head is None:  # tied, not prepacked nor quantized
            assert isinstance(self.embed_tokens, nn.Embedding)
            logits = F.linear(h, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(h).float()
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        rows: torch.Tensor,  # [N] int64, rows of T wanted
    ) -> torch.Tensor:  # [N, hidden] in the model's dtype
        """The final norm's output at ``rows``: what the LM head reads (embeddings pool it)."""
        h = self.embed_tokens(input_ids)
        if self.args.embed_scale is not None:
            h = h * torch.tensor(self.args.embed_scale, dtype=h.dtype)
        rope = self.rope.lookup(positions)  # the same for every layer (of a kind)
        local = rope if self.local_rope is None else self.local_rope.lookup(positions)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            h, residual = layer(h, residual, rope if layer.self_attn.window is None else local, meta)
        assert residual is not None, "a model has at least one layer"
        h, _ = self.norm.add_and_norm(h.index_select(0, rows), residual.index_select(0, rows))
        return h

    def build_rope(self, max_positions: int) -> None:
        """The rotary tables for ``max_positions`` (real buffers, after a meta-device build)."""
        self.rope = RotaryEmbedding(self.args.rotary_dim, max_positions, self.args.rope)
        if self.args.local_rope is not None:
            self.local_rope = RotaryEmbedding(self.args.rotary_dim, max_positions, self.args.local_rope)
