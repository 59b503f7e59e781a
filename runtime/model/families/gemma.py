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
            "final_softcap": None if caps[1] is None else float(caps[1])}


def _gguf_metadata(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """llama.cpp's Gemma keys in config.json terms. Its windowed layers: every layer but
    each ``sliding_window_pattern``-th (2 for Gemma 2, 6 for Gemma 3 when not written);
    the attention scale, when written, is ``query_pre_attn_scalar ** -0.5``."""
    layers = int(meta[f"{arch}.block_count"])
    pattern = int(meta.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6))
    cfg: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(meta[f"{arch}.attention.sliding_window"]),
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
    }
    scale = meta.get(f"{arch}.attention.scale")
    if scale is not None:
        cfg["query_pre_attn_scalar"] = float(scale) ** -2
    if arch == "gemma3":  # the windowed layers' own rope base (llama.cpp's default: 10000)
        full: dict[str, Any] = {"rope_theta": float(meta.get(f"{arch}.rope.freq_base", 1000000.0)),
                                "rope_type": "default"}
        if meta.get(f"{arch}.rope.scaling.type") == "linear":
            full.update(rope_type="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
        local = {"rope_theta": float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)), "rope_type": "default"}
        cfg["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return cfg


GEMMA2 = Family(
    name="gemma2",
    hf_model_types=("gemma2",),
    hf_architectures=("Gemma2ForCausalLM",),
    gguf_architectures=("gemma2",),
    sandwich_norms=True,
    gguf_metadata=_gguf_metadata,
    activations=("gelu_pytorch_tanh",),
    norm_offset=1.0,
    options=_options,
)

GEMMA3 = Family(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    hf_architectures=("Gemma3ForCausalLM",),
    gguf_architectures=("gemma3",),
    qk_norm=True,
    sandwich_norms=True,
    gguf_metadata=_gguf_metadata,
    activations=("gelu_pytorch_tanh",),
    norm_offset=1.0,
    options=_options,
)
