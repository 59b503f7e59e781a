"""A GGUF model's weights loaded as they are stored: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks
become ``QuantizedWeight`` codes and scales bit for bit (``weights="gguf"``), with no fp32
copy (Q5's 5-bit codes held in 8 bits).

What conversion (``convert.py``, through transformers) does to the numbers, we do to rows:
llama.cpp stores a Llama model's q and k projections with the rows of each head
interleaved for its rotary layout; undoing that is a row permutation, which moves whole
quantized rows. Tensors in other types (F32/F16 norms, or a linear in a K-quant we have
no kernel for: Q6_K, Q2_K, Q3_K, ...) are dequantized with the ``gguf`` package; such a
linear is then quantized to int8 in groups of 32, and the log says so. Q4_K and Q5_K blocks
load as groups of 32 (their scales rounded to fp16: ``kernels.reference.quant._from_k_quant``).
Every one of these is a format of groups of 32, so parts of a fused weight stored in
different ones (a file's v in Q6_K, its q and k in Q4_K) stack without requantizing: 4-bit
parts are widened to 8-bit codes (``widen``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels import QuantizedWeight
from kernels.reference.quant import (
    GGML_KINDS,
    cat_rows,
    dequantize,
    from_ggml_blocks,
    quantize_int8,
    widen,
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
        if kind in GGML_KINDS:
            raw = torch.from_numpy(np.array(t.data)).view(torch.uint8)  # a copy, as above
            return from_ggml_blocks(raw.reshape(int(t.shape[1]), -1), kind, in_features)
        log.info("GGUF tensor %s is %s: no kernel for it, quantizing to int8 in groups of 32", name, kind)
        return quantize_int8(self.dense(name).reshape(-1, in_features), blocks_per_group=1)


def _unpermute_rows(num_heads: int, rows: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute)."""
    half = rows // num_heads // 2
    return torch.arange(rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(rows)


Weights = dict[str, QuantizedWeight | torch.Tensor]  # our module names -> tensors


def load_gguf_model(path: Path, args: ModelArgs, max_positions: int,
                    cache_dir: Path | None = None) -> LlamaForCausalLM:
    """Build the model with every linear and the embedding table in the file's own
    quantized blocks and the norms in fp32 (CPU tensors).

    Reading a GGUF file's metadata costs seconds of Python (the ``gguf`` reader parses
    every tokenizer entry); with ``cache_dir`` the rearranged tensors are saved there once
    (safetensors, keyed by the file's path, size and mtime) and later loads read them.
    """
    cache = _cache_file(path, cache_dir) if cache_dir is not None else None
    if cache is not None and cache.exists():
        weights = _read_cache(cache)
    else:
        weights = _read_gguf(GGUFTensors(path), args)
        if cache is not None:
            _write_cache(weights, cache)
    return _build(weights, args, max_positions)


def _read_gguf(gg: GGUFTensors, args: ModelArgs) -> Weights:
    permute = gg.architecture == "llama"
    out: Weights = {"norm": gg.dense("output_norm.weight").reshape(-1),
                    "embed_tokens": gg.quantized("token_embd.weight")}
    if gg.has("output.weight"):
        out["lm_head"] = gg.quantized("output.weight")
    for i in range(args.num_layers):
        pre, dst = f"blk.{i}.", f"layers.{i}."
        q, k, v = (gg.quantized(pre + f"attn_{p}.weight") for p in "qkv")
        if permute:
            q = q.rows(_unpermute_rows(args.num_heads, q.out_features))
            k = k.rows(_unpermute_rows(args.num_kv_heads, k.out_features))
        out[dst + "qkv_proj"] = _fused(pre + "attn_qkv", [q, k, v])
        if args.qkv_bias:
            out[dst + "qkv_bias"] = torch.cat([gg.dense(pre + f"attn_{p}.bias") for p in "qkv"])
        out[dst + "o_proj"] = gg.quantized(pre + "attn_output.weight")
        gate_up = [gg.quantized(pre + f"ffn_{p}.weight") for p in ("gate", "up")]
        out[dst + "gate_up_proj"] = _fused(pre + "ffn_gate_up", gate_up)
        out[dst + "down_proj"] = gg.quantized(pre + "ffn_down.weight")
        out[dst + "input_layernorm"] = gg.dense(pre + "attn_norm.weight").reshape(-1)
        out[dst + "post_attention_layernorm"] = gg.dense(pre + "ffn_norm.weight").reshape(-1)
    return out


def _build(weights: Weights, args: ModelArgs, max_positions: int) -> LlamaForCausalLM:
    def quantized(name: str) -> QuantizedWeight:
        w = weights.get(name)
        if not isinstance(w, QuantizedWeight):
            raise ModelLoadError(f"quantized weight {name!r} missing")
        return w

    def dense(name: str) -> torch.Tensor:
        w = weights.get(name)
        if not isinstance(w, torch.Tensor):
            raise ModelLoadError(f"weight {name!r} missing")
        return w

    with torch.device("meta"):
        model = LlamaForCausalLM(args, max_positions)
    model.rope = type(model.rope)(args.head_dim, max_positions, args.rope)  # real buffers
    _set_norm(model.norm, dense("norm"))
    model.embed_tokens = QuantizedEmbedding(quantized("embed_tokens"))
    model.lm_head = QuantizedLinear(quantized("lm_head" if "lm_head" in weights else "embed_tokens"))
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        pre = f"layers.{i}."
        bias = dense(pre + "qkv_bias") if args.qkv_bias else None
        layer.self_attn.qkv_proj = QuantizedLinear(quantized(pre + "qkv_proj"), bias)
        layer.self_attn.o_proj = QuantizedLinear(quantized(pre + "o_proj"))
        layer.mlp.gate_up_proj = QuantizedLinear(quantized(pre + "gate_up_proj"))
        layer.mlp.down_proj = QuantizedLinear(quantized(pre + "down_proj"))
        _set_norm(layer.input_layernorm, dense(pre + "input_layernorm"))
        _set_norm(layer.post_attention_layernorm, dense(pre + "post_attention_layernorm"))
    return model.eval()


# ---- the cache of the rearranged tensors ---------------------------------------------------
# What a GGUF type loads as; part of the cache key, so a change here rebuilds the cache
# (2: Q5_0 / Q5_1 / Q5_K loaded as 8-bit codes, other types requantized in groups of 32).
CACHE_VERSION = 2


def _cache_file(path: Path, cache_dir: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{CACHE_VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_dir / f"gguf-native-{key[:12]}.safetensors"


def _write_cache(weights: Weights, file: Path) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    formats: dict[str, list[int | None]] = {}
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight):
            tensors.update({f"{name}.codes": w.codes, f"{name}.scales": w.scales, f"{name}.offsets": w.offsets})
            formats[name] = [w.bits, w.blocks_per_group, w.in_features]
        else:
            tensors[name] = w
    tmp = file.with_suffix(".partial")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"formats": json.dumps(formats)})
        tmp.replace(file)
    except OSError as exc:  # a read-only cache is not fatal: the next load reads the GGUF again
        log.warning("could not cache the GGUF-native weights in %s: %s", file, exc)


def _read_cache(file: Path) -> Weights:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            formats = json.loads((f.metadata() or {})["formats"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as exc:  # safetensors raises its own error types
        raise ModelLoadError(f"cannot read cached GGUF-native weights {file} (delete it to rebuild): "
                             f"{exc}") from exc
    out: Weights = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] not in formats}
    for name, (bits, blocks_per_group, in_features) in formats.items():
        out[name] = QuantizedWeight(tensors[f"{name}.codes"], tensors[f"{name}.scales"],
                                    tensors[f"{name}.offsets"], bits, blocks_per_group, in_features)
    return out


def _fused(name: str, parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts stacked into one weight. Parts of different code widths but the same groups (a
    file may keep v in Q8_0 or Q6_K and q, k in Q4) stack exactly, the 4-bit ones widened
    to 8-bit codes; parts of different groups are requantized together to int8 per channel."""
    if len({p.bits for p in parts}) > 1 and len({p.blocks_per_group for p in parts}) == 1:
        parts = [widen(p) for p in parts]
    if len({(p.bits, p.blocks_per_group) for p in parts}) == 1:
        return cat_rows(parts)
    log.info("GGUF %s: parts in different groups, quantizing the fused weight to int8", name)
    return quantize_int8(torch.cat([dequantize(p) for p in parts]))


def _set_norm(norm: RMSNorm, weight: torch.Tensor) -> None:
    norm.weight = torch.nn.Parameter(weight.reshape(-1), requires_grad=False)
