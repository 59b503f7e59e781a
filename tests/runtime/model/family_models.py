"""Tiny random-weight models of each family, as an HF directory (saved by transformers)
and as a GGUF file written with the ``gguf`` package from the very same weights, under
llama.cpp's tensor names and layout (its converter's q / k row permutation for the
``llama`` architecture, Llama 3's ``rope_freqs.weight``)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.model.gguf_file import GGUFFile

# HF name (below model.layers.N.) -> GGUF name (below blk.N.)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


# Gemma: HF's post_attention_layernorm is the attention's output norm; llama.cpp's names
_GEMMA_NORMS = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def _gemma_metadata(w: Any, cfg: dict[str, Any], arch: str) -> None:
    """What llama.cpp's Gemma converters write: caps, window, the attention scale; norms
    get their ``1 +`` folded in (in ``write_family_gguf``)."""
    w.add_sliding_window(cfg["sliding_window"])
    w.add_uint32(f"{arch}.attention.sliding_window_pattern",
                 next(i + 1 for i, k in enumerate(cfg["layer_types"]) if k == "full_attention"))
    w.add_float32(f"{arch}.attention.scale", cfg["query_pre_attn_scalar"] ** -0.5)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            w.add_float32(f"{arch}.{key}", cfg[key])
    rope = cfg["rope_parameters"]
    if "full_attention" in rope:  # Gemma 3: the global layers' scaling, the local layers' base
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_float32(f"{arch}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py) of a q or k weight."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(cfg: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter writes as ``rope_freqs.weight`` for llama3 scaling."""
    rope = cfg["rope_parameters"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_family_gguf(hf_dir: Path, out: Path, arch: str, tokenizer_source: GGUFFile, qtype: str = "F32",
                      permute_qk: bool = False, drop: tuple[str, ...] = (), metadata: dict[str, int] | None = None,
                      extra: Callable[[Any, dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
                      chat_template: str | None = None) -> Path:
    """``hf_dir``'s model as a GGUF file of ``arch`` (linears in ``qtype``, norms in F32),
    with ``tokenizer_source``'s tokenizer metadata; ``drop``: tensors left out;
    ``metadata``: more metadata (uint32 values); ``extra`` (writer, HF tensors) writes a
    family's own metadata and returns its own tensors (a mixture of experts':
    ``test_moe_families.py``); ``chat_template``: the file's own (else the source's)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    hf = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    gemma = arch in ("gemma2", "gemma3")
    if gemma:
        _gemma_metadata(w, cfg, arch)
    else:
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_rope_dimension_count(int(head_dim * cfg["rope_parameters"].get("partial_rotary_factor", 1.0)))
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("sliding_window") and not gemma:
        w.add_sliding_window(cfg["sliding_window"])
    meta = tokenizer_source.metadata
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"].tolist())
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(chat_template or meta["tokenizer.chat_template"])
    for key, value in (metadata or {}).items():
        w.add_uint32(key, value)
    tensors: dict[str, np.ndarray] = {"token_embd.weight": hf["model.embed_tokens.weight"],
                                      "output_norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf and not cfg.get("tie_word_embeddings"):
        tensors["output.weight"] = hf["lm_head.weight"]
    if gemma:
        tensors["output_norm.weight"] = tensors["output_norm.weight"] + 1.0
    if cfg["rope_parameters"].get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _llama3_rope_factors(cfg)
    if extra is not None:
        tensors.update(extra(w, hf))
    for i in range(cfg["num_hidden_layers"]):
        for src, dst in {**_LAYER_NAMES, **(_GEMMA_NORMS if gemma else {})}.items():
            name = f"model.layers.{i}.{src}"
            if name not in hf:
                continue
            value = hf[name] + 1.0 if gemma and "norm" in src else hf[name]
            if permute_qk and src == "self_attn.q_proj.weight":
                value = _llama_permute(value, heads)
            elif permute_qk and src == "self_attn.k_proj.weight":
                value = _llama_permute(value, kv_heads)
            tensors[f"blk.{i}.{dst}"] = value
    kind = gguf.GGMLQuantizationType[qtype]
    for name, value in tensors.items():
        if name in drop:
            continue
        value = np.ascontiguousarray(value, dtype=np.float32)
        if value.ndim == 1 or qtype == "F32":
            w.add_tensor(name, value)
        else:
            w.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def hf_greedy(model_dir: Path, ids: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of ``ids`` and its logits at every prompt position."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0].float()
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False)
    return out[0, len(ids):].tolist(), logits
