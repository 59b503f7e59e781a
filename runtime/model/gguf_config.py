"""What a GGUF file's metadata says about its model: the config and the expected tensors.

llama.cpp writes each architecture's numbers under its own prefix (``llama.block_count``,
``qwen2.embedding_length``...). The family registry (``runtime.model.families``) is the
one table of what differs between architectures, keyed by ``general.architecture`` among
other names; everything else is read the same way for all. The config comes out in HF's
``config.json`` vocabulary so the rest of the engine (``ModelArgs.from_hf_config``, the
KV pool sizing) reads one shape whichever way the model arrived.
"""

from __future__ import annotations

from typing import Any

from runtime.errors import ModelLoadError
from runtime.model.families import family_for_config, family_for_gguf
from runtime.model.family import Family
from runtime.model.gguf_file import GGUFFile
from runtime.model.mlp import mlp_block
from runtime.model.rope import rope_attention_factor


def architecture(gguf: GGUFFile) -> Family:
    """The family of ``gguf``'s ``general.architecture``.

    Raises:
        ModelLoadError: no registered family reads it (the message lists those that do).
    """
    try:
        return family_for_gguf(gguf.architecture)
    except ValueError as exc:
        raise ModelLoadError(f"{gguf.path}: {exc}") from exc


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The model's config in ``config.json`` terms, from the file's metadata alone."""
    meta, arch = gguf.metadata, gguf.architecture
    spec = architecture(gguf)

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{gguf.path}: metadata {arch}.{name} missing")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ModelLoadError(f"{gguf.path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens in the metadata")
    cfg: dict[str, Any] = {
        "model_type": spec.hf_model_types[0],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "rope_parameters": _rope(meta, arch, hidden // heads if f"{arch}.attention.key_length" not in meta
                                 else int(meta[f"{arch}.attention.key_length"])),
        "attention_bias": spec.qkv_bias,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
    }
    if "rope_freqs.weight" in gguf.tensors:  # Llama 3's scaled frequencies, as a tensor
        cfg["rope_parameters"] = _rope_factors(gguf, cfg["rope_parameters"])
    if "rope_factors_long.weight" in gguf.tensors:  # Phi-3's LongRoPE, as two tensors
        cfg["rope_parameters"] = _longrope(gguf, cfg["rope_parameters"], cfg["max_position_embeddings"])
    cfg.update(spec.gguf_metadata(meta, arch))
    for name in ("bos", "eos", "pad"):
        token_id = meta.get(f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id")
        if token_id is not None:
            cfg[f"{name}_token_id"] = int(token_id)
    # llama.cpp's end-of-generation tokens beside EOS (Llama 3's <|eot_id|>, <|eom_id|>)
    ends = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    if sum(e is not None for e in ends) > 1:
        cfg["eos_token_id"] = sorted({int(e) for e in ends if e is not None})
    return cfg


def _rope_factors(gguf: GGUFFile, rope: dict[str, Any]) -> dict[str, Any]:
    """The rope settings with llama.cpp's per-frequency divisors (``rope_freqs.weight``,
    what its converter writes for Llama 3's llama3 scaling): ``inv_freq / factors``."""
    if rope["rope_type"] != "default":
        raise ModelLoadError(f"{gguf.path}: rope_freqs.weight beside rope scaling {rope['rope_type']!r}")
    factors = gguf.dense("rope_freqs.weight").reshape(-1)
    return {**rope, "rope_type": "freq_factors", "freq_factors": factors.tolist()}


def _longrope(gguf: GGUFFile, rope: dict[str, Any], context_length: int) -> dict[str, Any]:
    """LongRoPE as llama.cpp's Phi-3 converter writes it: the long and short per-frequency
    divisors as ``rope_factors_long`` / ``rope_factors_short``, the attention scale it
    computed as ``rope.scaling.attn_factor``."""
    meta, arch = gguf.metadata, gguf.architecture
    if rope["rope_type"] != "default" or "rope_factors_short.weight" not in gguf.tensors:
        raise ModelLoadError(f"{gguf.path}: rope_factors_long.weight needs rope_factors_short.weight "
                             f"and no other rope scaling (has {rope['rope_type']!r})")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"{gguf.path}: metadata {arch}.rope.scaling.original_context_length missing "
                             "(LongRoPE picks its factors by it)")
    out = {**rope, "rope_type": "longrope", "original_max_position_embeddings": int(original),
           "max_position_embeddings": context_length,
           "long_factor": gguf.dense("rope_factors_long.weight").reshape(-1).tolist(),
           "short_factor": gguf.dense("rope_factors_short.weight").reshape(-1).tolist()}
    if f"{arch}.rope.scaling.attn_factor" in meta:
        out["attention_factor"] = float(meta[f"{arch}.rope.scaling.attn_factor"])
    return out


def _yarn(meta: dict[str, Any], arch: str, rope: dict[str, Any]) -> None:
    """YaRN as llama.cpp writes it; its ``attn_factor`` multiplies the scale YaRN computes
    (HF's ``attention_factor`` replaces it)."""
    if float(meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)) != 0.0:
        raise ModelLoadError(f"{arch}.rope.scaling.yarn_log_multiplier (DeepSeek's YaRN scale) is not supported")
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if f"{arch}.rope.scaling.{key}" in meta:
            rope[name] = float(meta[f"{arch}.rope.scaling.{key}"])
    rope.setdefault("original_max_position_embeddings", int(meta[f"{arch}.context_length"]))
    if f"{arch}.rope.scaling.attn_factor" in meta:
        rope["attention_factor"] = float(meta[f"{arch}.rope.scaling.attn_factor"]) * rope_attention_factor(rope)


def _rope(meta: dict[str, Any], arch: str, head_dim: int) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)), "rope_type": "default"}
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:  # partial rotary (Phi-4-mini)
        rope["partial_rotary_factor"] = int(rotary) / head_dim
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in ("linear", "yarn"):
        rope["rope_type"] = kind
        rope["factor"] = float(meta[f"{arch}.rope.scaling.factor"])
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope["original_max_position_embeddings"] = int(original)
        if kind == "yarn":
            _yarn(meta, arch, rope)
    elif kind not in (None, "none"):
        raise ModelLoadError(f"rope scaling {kind!r} ({arch}.rope.scaling.type) is not supported")
    return rope


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of ``cfg`` reads, with its GGUF shape (innermost dim first)."""
    try:
        family = family_for_config(cfg)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    hidden, vocab, mlp, qk_norm = cfg["hidden_size"], cfg["vocab_size"], family.mlp, family.qk_norm
    q_rows = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_rows = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (hidden, vocab), "output_norm.weight": (hidden,)}
    if not cfg["tie_word_embeddings"]:
        shapes["output.weight"] = (hidden, vocab)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"blk.{i}."
        shapes.update({
            pre + "attn_norm.weight": (hidden,), pre + "ffn_norm.weight": (hidden,),
            **({pre + "post_attention_norm.weight": (hidden,), pre + "post_ffw_norm.weight": (hidden,)}
               if family.sandwich_norms else {}),
            pre + "attn_output.weight": (q_rows, hidden),
        })
        if family.fused_qkv:
            shapes[pre + "attn_qkv.weight"] = (hidden, q_rows + 2 * kv_rows)
        else:
            shapes.update({pre + "attn_q.weight": (hidden, q_rows), pre + "attn_k.weight": (hidden, kv_rows),
                           pre + "attn_v.weight": (hidden, kv_rows)})
        shapes.update(mlp_block(mlp).gguf_shapes(cfg, pre))
        if qk_norm:
            shapes.update({pre + f"attn_{p}_norm.weight": (cfg["head_dim"],) for p in "qk"})
        if cfg["attention_bias"]:
            shapes.update({pre + "attn_q.bias": (q_rows,), pre + "attn_k.bias": (kv_rows,),
                           pre + "attn_v.bias": (kv_rows,)})
    return shapes


def check_tensors(gguf: GGUFFile, cfg: dict[str, Any]) -> None:
    """Raise ``ModelLoadError`` naming the first tensor that is missing or whose shape
    contradicts the metadata (checked before any weight is read)."""
    for name, shape in expected_shapes(cfg).items():
        info = gguf.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{gguf.path}: tensor {name!r} missing")
        # NOTE: ggml may drop trailing dims of 1 (a [hidden, 1] tensor is stored as [hidden])
        stored = info.shape + (1,) * (len(shape) - len(info.shape))
        if stored != shape:
            raise ModelLoadError(f"{gguf.path}: tensor {name!r} has shape {list(info.shape)}, but the "
                                 f"metadata ({gguf.architecture}.*) implies {list(shape)}")
