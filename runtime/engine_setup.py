"""Decisions made once when an engine starts: device, dtype, the model and its tokenizer,
KV pool size, native kernels, the garbage collector."""

from __future__ import annotations

import atexit
import gc
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import kernels
from kernels import onednn
from kernels.cpu import NativeBuildError
from runtime import env
from runtime.config import DEFAULT_MEM_FRACTION, EngineConfig
from runtime.errors import InvalidRequestError
from runtime.model.kv_cache import KVCache
from runtime.model.llama import LlamaForCausalLM
from runtime.model.loader import load_model, load_tokenizer, read_config, resolve_model_dir
from runtime.model.parallel import ShardPlan, add_collectives, shard_model

log = logging.getLogger(__name__)
_gc_unfreeze_registered = False

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device 'cuda' requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """fp32 on the CPU (bf16 matmuls are ~25x slower there), bf16 on CUDA by default."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise InvalidRequestError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {name!r}")
    return _DTYPES[name]


def use_prepacked_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN-prepacked linears pay on the CPU in fp32 (see ``kernels.onednn``)."""
    return device.type == "cpu" and dtype == torch.float32 and onednn.available()


def enable_cpu_kernels() -> None:
    """Build (once per machine, ~1 s) and use the native CPU kernels; without a C compiler
    the torch reference stays in use, with a warning."""
    try:
        kernels.enable_cpu_kernels(env.cache_dir() / "kernels")
    except NativeBuildError as exc:
        log.warning("native CPU kernels unavailable, using the torch reference: %s", exc)


def freeze_gc() -> None:
    """Collect, then freeze every live object (see ``EngineConfig.freeze_gc``). They are
    unfrozen at exit, so the interpreter's last collection still finalizes them (extension
    types such as Triton's complain about instances that outlive it)."""
    global _gc_unfreeze_registered
    gc.collect()
    gc.freeze()
    if not _gc_unfreeze_registered:
        atexit.register(gc.unfreeze)
        _gc_unfreeze_registered = True


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def size_pool(
    cfg: EngineConfig, hf_config: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> tuple[int, int]:
    """Returns (num_pages, max_model_len).

    ``num_pages`` comes from the config or from ``mem_fraction`` of free memory;
    ``max_model_len`` is capped by the model's positions and by the pool, so one request
    alone always fits (retraction can then always make progress).
    """
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    per_token = KVCache.bytes_per_token(int(hf_config["num_hidden_layers"]), kv_heads, head_dim, dtype)
    if cfg.num_pages is not None:
        num_pages = cfg.num_pages
    else:
        fraction = cfg.mem_fraction if cfg.mem_fraction is not None else DEFAULT_MEM_FRACTION
        num_pages = int(_free_memory_bytes(device) * fraction) // (per_token * cfg.page_size)
    capacity = (num_pages - 1) * cfg.page_size
    model_len = int(hf_config.get("max_position_embeddings", 2048))
    max_len = min(cfg.max_model_len or model_len, capacity)
    if max_len < 2:
        raise InvalidRequestError(f"the KV pool ({num_pages} pages) is too small for any request")
    return num_pages, max_len


@dataclass(frozen=True)
class LoadedModel:
    """What an engine starts from, decided once."""

    config: EngineConfig  # with the device-dependent defaults filled in
    device: torch.device
    dtype: torch.dtype
    model_dir: Path  # the HF-style directory (a GGUF file's cached conversion)
    tokenizer: Any  # transformers tokenizer
    hf_config: dict[str, Any]
    model: LlamaForCausalLM
    num_pages: int
    max_model_len: int


def load_engine_model(requested: EngineConfig, rank: int = 0) -> LoadedModel:
    """Resolve device and dtype, load tokenizer and model, size the KV pool, and pick the
    fast paths for this device (prepacked linears, native CPU kernels). With tensor
    parallelism, the model is ``rank``'s shard (``runtime.model.parallel``)."""
    if requested.num_threads:
        torch.set_num_threads(requested.num_threads)
    device = resolve_device(requested.device)
    world = requested.tensor_parallel_size
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", rank % (world // requested.nnodes))
    cfg = requested.for_device(device.type)
    dtype = resolve_dtype(cfg.dtype, device)
    model_dir = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(model_dir)
    hf_config = read_config(model_dir)
    num_pages, max_model_len = size_pool(cfg, hf_config, device, dtype)
    model = load_model(model_dir, device, dtype, max_model_len)
    plan = ShardPlan.build(model.args, rank, world) if world > 1 else None
    if plan is not None:
        shard_model(model, plan)
    if cfg.prepack_weights and use_prepacked_linears(device, dtype):
        model.prepack_linears()
    if plan is not None:
        add_collectives(model, plan)
    if device.type == "cpu":
        enable_cpu_kernels()
    return LoadedModel(cfg, device, dtype, model_dir, tokenizer, hf_config, model, num_pages, max_model_len)
