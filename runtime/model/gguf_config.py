"""What a GGUF file's metadata says about its model: the config and the expected tensors.

llama.cpp writes each architecture's numbers under its own prefix (``llama.block_count``,
``qwen2.embedding_length``...). ``ARCHITECTURES`` is the one table, keyed by
``general.architecture``, of what differs between the families we run; everything else
is read the same way for all. The config comes out in HF's ``config.json`` vocabulary so
the rest of the engine (``ModelArgs.from_hf_config``, the KV pool sizing) reads one shape
whichever way the model arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.errors import ModelLoadError
from runtime.model.gguf_file import GGUFFile


@dataclass(frozen=True)
class Architecture:
    """How one ``general.architecture`` maps onto our model."""

    model_type: str  # HF's model_type (what ModelArgs.from_hf_config reads)
    # llama.cpp's converter permutes the rows of each q / k head for its rotary layout
    # (``LlamaModel.permute`` in convert_hf_to_gguf.py); loading undoes it
    permuted_qk: bool
    qkv_bias: bool  # q / k / v projections carry a bias (blk.N.attn_q.bias...)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", permuted_qk=True, qkv_bias=False),  # also Mistral, SmolLM, TinyLlama
    "qwen2": Architecture("qwen2", permuted_qk=False, qkv_bias=True),
}


def architecture(gguf: GGUFFile) -> Architecture:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{gguf.path}: architecture {arch!r} is not supported "
                             f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[arch]


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
        "model_type": spec.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "rope_parameters": _rope(meta, arch),
        "attention_bias": spec.qkv_bias,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
    }
    if "rope_freqs.weight" in gguf.tensors:  # Llama 3's scaled frequencies, as a tensor
        raise ModelLoadError(f"{gguf.path}: per-frequency rope factors (rope_freqs.weight) are not supported yet")
    for name in ("bos", "eos", "pad"):
        token_id = meta.get(f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id")
        if token_id is not None:
            cfg[f"{name}_token_id"] = int(token_id)
    return cfg


def _rope(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)), "rope_type": "default"}
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind == "linear":
        rope["rope_type"] = kind
        rope["factor"] = float(meta[f"{arch}.rope.scaling.factor"])
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope["original_max_position_embeddings"] = int(original)
    elif kind not in (None, "none"):
        raise ModelLoadError(f"rope scaling {kind!r} is not supported")
    return rope


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of ``cfg`` reads, with its GGUF shape (innermost dim first)."""
    hidden, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_rows = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_rows = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (hidden, vocab), "output_norm.weight": (hidden,)}
    if not cfg["tie_word_embeddings"]:
        shapes["output.weight"] = (hidden, vocab)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"blk.{i}."
        shapes.update({
            pre + "attn_norm.weight": (hidden,), pre + "ffn_norm.weight": (hidden,),
            pre + "attn_q.weight": (hidden, q_rows), pre + "attn_k.weight": (hidden, kv_rows),
            pre + "attn_v.weight": (hidden, kv_rows), pre + "attn_output.weight": (q_rows, hidden),
            pre + "ffn_gate.weight": (hidden, ffn), pre + "ffn_up.weight": (hidden, ffn),
            pre + "ffn_down.weight": (ffn, hidden),
        })
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
