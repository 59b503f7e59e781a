"""Decisions made once when an engine starts: device, dtype, the model and its tokenizer,
KV pool size, native kernels, the garbage collector."""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

import kernels
from kernels import UnsupportedDecodeModel, onednn
from kernels.cpu import NativeBuildError
from runtime import env
from runtime.config import CPU_PREFIX_CACHE_BYTES, DEFAULT_MEM_FRACTION, EngineConfig
from runtime.errors import InvalidRequestError, ModelLoadError
from runtime.model.fused_decode import FusedDecode
from runtime.model.gguf_config import check_tensors
from runtime.model.gguf_config import hf_config as gguf_hf_config
from runtime.model.gguf_file import GGUFFile
from runtime.model.gguf_tokenizer import check_tokenizer, gguf_tokenizer
from runtime.model.gguf_weights import gguf_state_dict, load_gguf_model
from runtime.model.kv_cache import KVCache
from runtime.model.llama import LlamaForCausalLM, ModelArgs
from runtime.model.loader import (
    build_model,
    load_model,
    load_tokenizer,
    model_args,
    read_config,
    resolve_source,
)
from runtime.model.memory import (
    MemoryPlan,
    available_memory_bytes,
    kv_bytes_per_token,
    load_peak_nbytes,
    weights_nbytes,
)
from runtime.model.mlp import mlp_block
from runtime.model.parallel import ShardPlan, add_collectives, shard_model
from runtime.model.quant import move_quantized, prepare_quantized, quantize_model
from runtime.model.rope import rope_context_problem

log = logging.getLogger(__name__)
T = TypeVar("T")
_gc_unfreeze_registered = False

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device 'cuda' requested but CUDA is not available")
    return device


def resolve_weights(name: str, device: torch.device, gguf_source: bool = False, tensor_parallel_size: int = 1) -> str:
    """The weight format: "auto" is the source's own, "gguf" for a GGUF file (its blocks,
    not dequantized) and "fp32" for an HF directory; "fp32" too with tensor parallelism,
    which shards fp32 weights only.

    Raises:
        ModelLoadError: "gguf" asked of an HF directory (no blocks to load).
    """
    if name == "auto":
        return "gguf" if gguf_source and tensor_parallel_size == 1 else "fp32"
    if name == "gguf" and not gguf_source:
        raise ModelLoadError("weights='gguf' needs a .gguf model file (or the default model)")
    return name


def resolve_dtype(name: str, device: torch.device, weights: str = "fp32") -> torch.dtype:
    """fp32 on the CPU (bf16 matmuls are ~25x slower there), bf16 on CUDA by default;
    quantized weights compute in fp32 everywhere."""
    if weights != "fp32":
        if name not in ("auto", "float32"):
            raise InvalidRequestError(f"weights={weights!r} computes in float32; got dtype={name!r}")
        return torch.float32
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise InvalidRequestError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {name!r}")
    return _DTYPES[name]


def resolve_kv_dtype(name: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's stored dtype: the model's for "auto", else int8 / fp8 e4m3 codes.

    Raises:
        InvalidRequestError: fp8 on a CUDA device without fp8 (compute capability < 8.9),
            where the Triton kernels cannot convert it.
    """
    if name == "auto":
        return dtype
    if name == "int8":
        return torch.int8
    if name != "fp8":
        raise InvalidRequestError(f"kv_cache_dtype must be 'auto', 'int8' or 'fp8', got {name!r}")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise InvalidRequestError(
            f"kv_cache_dtype 'fp8' needs a GPU with fp8 (compute capability >= 8.9); "
            f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}. "
            "Use kv_cache_dtype='int8'.")
    return torch.float8_e4m3fn


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


def fused_decode(cfg: EngineConfig, model: LlamaForCausalLM, kv: KVCache, device: torch.device) -> FusedDecode | None:
    """The fused decode step when ``cfg.fused_decode`` asks for it and the model fits (CPU,
    block-quantized weights, native kernels built, one rank); else None, with the reason
    logged at debug level (fp32 weights are the common, expected case)."""
    if not cfg.fused_decode or cfg.tensor_parallel_size > 1:
        return None
    try:
        return FusedDecode.build(model, kv, device)
    except UnsupportedDecodeModel as exc:
        log.debug("fused decode step not used: %s", exc)
        return None


def on_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run on a thread of its own that ends with it: its result, or its exception.

    NOTE: for torch work outside the engine loop (the model load, ``Engine.score``).
    libgomp keeps an OpenMP team for every thread that opened a parallel region, for as
    long as that thread lives, and once it manages more threads than there are CPUs it
    lets waiting threads spin only ~1000 times before they sleep, so every parallel region
    of the engine thread then pays a futex wake. Left to the caller's (long-lived) thread,
    the load's team did exactly that, and decode slowed by up to half
    (docs/benchmarks.md#openmp_team_per_thread). A team of a thread that ends is freed.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # NOTE: re-raised on the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=run, name="arbor-torch-work")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


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


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off for the block (on again after it, if it was on).

    NOTE: a load allocates many Python objects (the tokenizer's strings, the modules
    transformers imports), and each gen-2 collection they trigger walks every object alive,
    torch's included; the engine's ``freeze_gc`` collects once after the load instead."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def size_pool(
    cfg: EngineConfig, hf_config: dict[str, Any], device: torch.device, kv_dtype: torch.dtype
) -> tuple[int, int]:
    """Returns (num_pages, max_model_len).

    ``num_pages`` comes from the config; or from ``mem_fraction`` of free memory; or, with
    neither, from what the engine will serve: ``max_running_requests`` requests of
    ``max_model_len`` tokens each, at most ``DEFAULT_MEM_FRACTION`` of free memory. Bytes
    are the pool's real ones per token (``kv_dtype``'s, with an 8-bit pool's scales).
    ``max_model_len`` is capped by the model's positions and by the pool, so one request
    alone always fits (retraction can then always make progress).
    """
    per_token = kv_bytes_per_token(hf_config, kv_dtype)
    model_len = int(hf_config.get("max_position_embeddings", 2048))
    if cfg.num_pages is not None:
        num_pages = cfg.num_pages
    else:
        fraction = cfg.mem_fraction if cfg.mem_fraction is not None else DEFAULT_MEM_FRACTION
        num_pages = int(_free_memory_bytes(device) * fraction) // (per_token * cfg.page_size)
        if cfg.mem_fraction is None:  # NOTE: +1: page 0 is the padding page
            served = cfg.max_running_requests * min(cfg.max_model_len or model_len, model_len)
            num_pages = min(num_pages, -(-served // cfg.page_size) + 1)
    capacity = (num_pages - 1) * cfg.page_size
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
    kv_dtype: torch.dtype  # the KV pool's stored dtype (``resolve_kv_dtype``)
    model_dir: Path  # the model's source: an HF-style directory or a .gguf file
    tokenizer: Any  # transformers tokenizer
    hf_config: dict[str, Any]
    model: LlamaForCausalLM
    num_pages: int
    max_model_len: int
    weights: str  # the format the weights are held in ("auto" resolved)
    memory: MemoryPlan  # weights and KV pool bytes, as planned before loading


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
    source = resolve_source(cfg.model)
    gguf = GGUFFile(source) if source.is_file() else None  # NOTE: a bad file fails here, before any load
    try:
        weights = resolve_weights(cfg.weights, device, gguf is not None, world)
        dtype = resolve_dtype(cfg.dtype, device, weights)
        if gguf is not None:
            hf_config = gguf_hf_config(gguf)
            check_tensors(gguf, hf_config)
            check_tokenizer(gguf)
        else:
            hf_config = read_config(source)
        args = model_args(hf_config, source)
        check_family_support(args, weights, world)  # NOTE: before anything is built
        if gguf is None:
            tokenizer = load_tokenizer(source)
        kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, device, dtype)
        num_pages, max_model_len = size_pool(cfg, hf_config, device, kv_dtype)
        if (problem := rope_context_problem(args.rope, max_model_len)) is not None:
            raise InvalidRequestError(problem)
        memory = plan_memory(hf_config, weights, gguf, kv_dtype, num_pages * cfg.page_size, world)
        if device.type == "cpu":
            memory.check_fits(f"model {source}")
        log.info("model %s (%s weights): %s", source, weights, memory.describe())
        with paused_gc():
            if gguf is not None:
                # NOTE: the disk reads of a file not in the page cache then overlap the
                # tokenizer's build. Building it on a second thread during the weights' load
                # cost CPU time (the OpenMP team spun while the threads passed the GIL) and
                # gained no wall time on 2 cores (benchmarks/results/bench_load_1b_*.json).
                gguf.prefetch()
                tokenizer = gguf_tokenizer(gguf)
            model = _load_weights(source, gguf, weights, device, dtype, max_model_len, hf_config)
    finally:
        if gguf is not None:
            gguf.close()
    plan = ShardPlan.build(model.args, rank, world) if world > 1 else None
    if plan is not None:
        shard_model(model, plan)
    if weights == "fp32" and cfg.prepack_weights and use_prepacked_linears(device, dtype):
        model.prepack_linears()
    if plan is not None:
        add_collectives(model, plan)
    if device.type == "cpu":
        enable_cpu_kernels()
        prepare_quantized(model)
        return_freed_heap()
    return LoadedModel(cfg, device, dtype, kv_dtype, source, tokenizer, hf_config, model, num_pages, max_model_len,
                       weights, memory)


def prefix_cache_max_pages(cfg: EngineConfig, device: torch.device, kv_bytes_per_token: int) -> int | None:
    """The prefix cache's bound on kept pages: the setting, else on the CPU the pages
    ``CPU_PREFIX_CACHE_BYTES`` hold (there the pool is touched lazily, so a cached page is
    resident memory), else None (CUDA reserves the whole pool at start: caching is free)."""
    if cfg.prefix_cache_max_pages is not None or device.type != "cpu":
        return cfg.prefix_cache_max_pages
    return max(1, CPU_PREFIX_CACHE_BYTES // (kv_bytes_per_token * cfg.page_size))


def check_family_support(args: ModelArgs, weights: str, world: int) -> None:
    """Refuse, before anything is loaded, what the model's MLP block cannot do.

    Raises:
        InvalidRequestError: naming the family, its block and the option (int8 / int4
            weights, tensor parallelism).
    """
    block = mlp_block(args.mlp)
    wanted = ([weights] if weights in ("int8", "int4") else []) + (["tensor_parallel"] if world > 1 else [])
    for option in wanted:
        if option not in block.supports:
            raise InvalidRequestError(f"the {args.family} family's {block.name!r} MLP block does not support "
                                      f"{'tensor parallelism' if option == 'tensor_parallel' else f'weights={option!r}'}")


def plan_memory(hf_config: dict[str, Any], weights: str, gguf: GGUFFile | None, kv_dtype: torch.dtype,
                kv_tokens: int, world: int = 1) -> MemoryPlan:
    """The memory the engine will hold (this rank's share with tensor parallelism)."""
    return MemoryPlan(weights_nbytes(hf_config, weights, gguf) // world,
                      load_peak_nbytes(hf_config, weights, gguf) // world,
                      kv_bytes_per_token(hf_config, kv_dtype) // world, kv_tokens, available_memory_bytes())


def return_freed_heap() -> bool:
    """Hand the heap that loading freed back to the OS; False where the C library has no
    ``malloc_trim`` (not glibc). glibc keeps freed chunks resident: after converting the
    fp32 checkpoint to int8 weights an engine held ~400-500 MiB it no longer used (default
    model: 1,497 -> 1,099 MiB RSS once trimmed, measured; fp32 weights: 18 MiB)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def _load_weights(
    source: Path, gguf: GGUFFile | None, weights: str, device: torch.device, dtype: torch.dtype,
    max_model_len: int, hf_config: dict[str, Any],
) -> LlamaForCausalLM:
    """The model with its weights in the ``weights`` format: a GGUF file's blocks as they
    are ("gguf"), or dequantized tensor by tensor from its map (fp32, then int8 / int4)."""
    args = model_args(hf_config, source)
    if gguf is not None and weights == "gguf":
        if device.type == "cpu":  # NOTE: before the load, so its blocks go straight to the kernels' layout
            enable_cpu_kernels()
        model = load_gguf_model(gguf, args, max_model_len, tiles=device.type == "cpu" and kernels.reads_tiles())
        model.to(device)
        move_quantized(model, device)
        return model
    if gguf is not None:
        model = build_model(args, gguf_state_dict(gguf, args), device, dtype, max_model_len)
    else:
        model = load_model(source, device, dtype, max_model_len)
    if weights in ("int8", "int4"):
        quantize_model(model, weights)
        _own_storage(model)
    return model


def _own_storage(model: torch.nn.Module) -> None:
    """Copy the tensors the model still holds (norms, biases) out of the checkpoint. They
    are views into the mmapped safetensors file, and while one lives the whole file's pages
    stay mapped: an int8 engine of the default model kept 513 MiB of the fp32 file resident
    beside its 131 MiB of weights (measured in /proc/self/smaps)."""
    for param in model.parameters():  # NOTE: the buffers (rope tables) are computed, not read
        param.data = param.data.clone()
