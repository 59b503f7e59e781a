"""What a model will cost in memory, known before anything is loaded.

Weights: from the tensor shapes the config implies (``gguf_config.expected_shapes``) and,
for a GGUF file, each tensor's stored type, in the layout we hold it in. KV pool: bytes per
token (``KVCache.bytes_per_token``) times the tokens the pool holds. Both are printed when an
engine starts and by ``arbor models inspect``; a model that cannot fit is refused with
these numbers before a byte of it is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

import kernels
from runtime.errors import ModelLoadError
from runtime.model.gguf_config import expected_shapes
from runtime.model.gguf_file import GGUFFile
from runtime.model.gguf_weights import q6_k_native
from runtime.model.kv_cache import KVCache

GROUP_BYTES_PER_ELEMENT = 4 / 32  # an fp16 scale and offset per group of 32 elements
Q6_K_BYTES_PER_ELEMENT = (272 + 4) / 256  # Q6_K's tiles: a byte a code, sub-block scales, d and -32 d
_FOUR_BIT_KINDS = ("Q4_0", "Q4_1", "Q4_K")  # held as 4-bit codes; Q6_K as stored; others as 8-bit
_FIVE_BIT_KINDS = ("Q5_0", "Q5_1", "Q5_K")  # held as 5-bit codes (so are 4-bit parts fused beside them)
# fused weights: their parts are held in one format (4-bit parts widened beside 8-bit ones)
_FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
GiB = 1024**3


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def config_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """``expected_shapes`` of an HF ``config.json`` as well as of a GGUF-derived config."""
    heads = int(cfg["num_attention_heads"])
    full = {
        **cfg,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        "attention_bias": bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }
    return expected_shapes(full)


def parameter_count(cfg: dict[str, Any]) -> int:
    return sum(_numel(s) for s in config_shapes(cfg).values())


def weights_nbytes(cfg: dict[str, Any], weights: str, gguf: GGUFFile | None = None) -> int:
    """Bytes the model's weights take once loaded in ``weights`` format ("gguf", "fp32",
    "int8", "int4"; norms and biases in fp32)."""
    shapes = config_shapes(cfg)
    if weights == "gguf":
        assert gguf is not None, "weights='gguf' needs the file's tensor types"
        return _gguf_nbytes(shapes, gguf)
    per_element = {"fp32": 4.0, "int8": 1.0 + 4 / _row(shapes), "int4": 0.5 + GROUP_BYTES_PER_ELEMENT}[weights]
    return int(sum(_numel(s) * (per_element if len(s) > 1 else 4.0) for s in shapes.values()))


def load_peak_nbytes(cfg: dict[str, Any], weights: str, gguf: GGUFFile | None = None) -> int:
    """The most the weights take while loading: int8 / int4 are quantized from the fp32
    model, so they pass through its size; the others are read tensor by tensor."""
    return weights_nbytes(cfg, "fp32" if weights in ("int8", "int4") else weights, gguf)


def _row(shapes: dict[str, tuple[int, ...]]) -> int:
    return max(s[0] for s in shapes.values())


def _gguf_nbytes(shapes: dict[str, tuple[int, ...]], gguf: GGUFFile) -> int:
    def kind(name: str) -> str:
        info = gguf.tensors.get(name)
        return "F32" if info is None else info.type_name

    kinds = {name: {kind(name)} for name in shapes}
    for name in shapes:  # a fused weight's parts are held in one format
        for group in _FUSED:
            stem = next((g for g in group if f".{g}.weight" in name), None)
            if stem is not None:
                kinds[name] = {kind(name.replace(f".{stem}.", f".{g}.")) for g in group}
    tiles = kernels.reads_tiles()
    total = 0
    for name, shape in shapes.items():
        if len(shape) == 1:
            total += _numel(shape) * 4
            continue
        padded = -(-shape[0] // 64) * 64 * _numel(shape[1:])
        total += int(padded * _bytes_per_element(kinds[name], q6_k_native(_numel(shape[1:]), tiles)))
    return total


def _bytes_per_element(kinds: set[str], q6_k_as_stored: bool) -> float:
    """Bytes an element of a weight stored in ``kinds`` (its fused parts' types) takes: Q6_K
    in its tiles (its d and -32 d per 256) where ``gguf_weights.q6_k_native``; 4-bit kinds
    as 4-bit codes; 5-bit kinds, alone or beside 4-bit ones, as 5-bit codes; everything
    else, and a mix with Q6_K, as 8-bit codes; scales and offsets fp16 per group of 32."""
    if kinds == {"Q6_K"} and q6_k_as_stored:
        return Q6_K_BYTES_PER_ELEMENT
    bits = 4 if kinds <= set(_FOUR_BIT_KINDS) else 5 if kinds <= {*_FOUR_BIT_KINDS, *_FIVE_BIT_KINDS} else 8
    return bits / 8 + GROUP_BYTES_PER_ELEMENT


def kv_bytes_per_token(cfg: dict[str, Any], kv_dtype: torch.dtype) -> int:
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return KVCache.bytes_per_token(int(cfg["num_hidden_layers"]), kv_heads, head_dim, kv_dtype)


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """Memory the kernel says a new allocation can take without swapping (MemAvailable:
    free plus reclaimable cache), else free pages."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


@dataclass(frozen=True)
class MemoryPlan:
    """What an engine will hold: its numbers, printed at start."""

    weights_bytes: int  # the loaded weights
    load_peak_bytes: int  # the weights' most while loading (int8/int4 pass through fp32)
    kv_bytes_per_token: int
    kv_tokens: int  # tokens the KV pool holds
    available_bytes: int  # MemAvailable when planned

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.kv_tokens

    @property
    def peak_bytes(self) -> int:
        return max(self.load_peak_bytes, self.weights_bytes) + self.kv_bytes

    def describe(self) -> str:
        return (f"weights {self.weights_bytes / GiB:.2f} GiB (load peak {self.load_peak_bytes / GiB:.2f} GiB), "
                f"KV pool {self.kv_tokens} tokens x {self.kv_bytes_per_token} B = {self.kv_bytes / GiB:.2f} GiB; "
                f"{self.available_bytes / GiB:.1f} GiB available")

    def check_fits(self, what: str) -> None:
        """Raise ``ModelLoadError`` with the numbers when weights + KV pool exceed the
        available memory (before anything is allocated)."""
        if self.peak_bytes > self.available_bytes:
            raise ModelLoadError(
                f"{what} does not fit in memory: needs {self.peak_bytes / GiB:.2f} GiB "
                f"({self.describe()}). Use a smaller KV pool (num_pages, max_model_len, "
                "max_running_requests), an 8-bit KV cache, or a smaller weight format.")
