"""Gemma 2 and Gemma 3 (text): Llama's decoder with

- RMSNorms of ``x * (1 + w)`` (the 1 is folded into the weights at load, as llama.cpp's
  converter does: a GGUF file holds them folded already);
- sandwich norms: each block's output is normed before its residual add;
- embeddings scaled by ``sqrt(hidden)``; GeGLU (tanh-approximated GELU) MLPs;
- attention scaled by ``query_pre_attn_scalar ** -0.5``; sliding-window and global layers
  alternating (``layer_types``); Gemma 3's windowed layers use their own rope base;
- Gemma 2: attention scores and final logits soft-capped (``cap * tanh(x / cap)``);
  Gemma 3: an RMSNorm over each q and k head instead.
"""

from __future__ import annotations

from typing import Any

from runtime.model.family import Family

_OPTIONAL_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def _options(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    caps = [cfg.get(key) for key in _OPTIONAL_CAPS]
    scalar = cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"embed_scale": float(cfg["hidden_size"]) ** 0.5, "attn_scale": float(scalar) ** -0.5,
            "attn_softcap": None if caps[0] is None else float(caps[0]),
            "final_softcap": None if caps[1] is None else float(caps[1]), "sandwich_norms": True}


GEMMA2 = Family(
    name="gemma2",
    hf_model_types=("gemma2",),
    hf_architectures=("Gemma2ForCausalLM",),
    activations=("gelu_pytorch_tanh",),
    norm_offset=1.0,
    options=_options,
)

GEMMA3 = Family(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    hf_architectures=("Gemma3ForCausalLM",),
    qk_norm=True,
    activations=("gelu_pytorch_tanh",),
    norm_offset=1.0,
    options=_options,
)
