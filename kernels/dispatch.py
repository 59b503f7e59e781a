"""One dispatcher for every op: Triton on CUDA; on the CPU, the native C kernels where one
exists and has been built (``enable_cpu_kernels``), the torch reference otherwise.

The choice is per call, by the device of the inputs, unless overridden with
``set_kernel_backend("torch" | "cpu" | "triton" | "auto")``. Forcing "triton" runs the
Triton kernels whatever the device: on CPU tensors that needs ``TRITON_INTERPRET=1`` in
the environment when the kernel modules are first imported (the kernel tests do this).
"cpu" uses a native kernel where there is one and the reference for the other ops.

The Triton modules are imported lazily, on the first call that uses them, so importing
``kernels`` never imports Triton; the C kernels are compiled only by ``enable_cpu_kernels``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from kernels import reference
from kernels.cpu import CpuElementwise, CpuKernels, NativeBuildError
from kernels.cpu.decode_step import (
    BoundDecodeStep,
    DecodeModelWeights,
    DecodePool,
    UnsupportedDecodeModel,
)
from kernels.cpu.quant_linear import CpuQuantLinear
from kernels.reference.attention import AttentionPlan, SharedPrefix
from kernels.reference.moe import ExpertGroups, ExpertWeights, combine, grouped_experts
from kernels.reference.quant import TILE_ROWS, QuantizedWeight, tile

KernelBackend = Literal["auto", "torch", "cpu", "triton"]
_backend: KernelBackend = "auto"
_cpu: CpuKernels | None = None  # set by enable_cpu_kernels
_cpu_build_error: NativeBuildError | None = None  # a failed build is not retried


def enable_cpu_kernels(cache_dir: Path) -> None:
    """Compile (once per machine, cached in ``cache_dir``) and load the native CPU kernels;
    from then on "auto" uses them for CPU tensors.

    Raises:
        kernels.cpu.NativeBuildError: no C compiler, or the build failed (then again on
            every later call, without retrying); the torch reference stays in use.
    """
    global _cpu, _cpu_build_error
    if _cpu is not None:
        return
    if _cpu_build_error is not None:
        raise _cpu_build_error
    try:
        _cpu = CpuKernels.build(cache_dir)
    except NativeBuildError as exc:
        _cpu_build_error = exc
        raise


def set_kernel_backend(name: KernelBackend) -> None:
    """Force one implementation for every op ("auto" restores device-based choice)."""
    global _backend
    if name not in ("auto", "torch", "cpu", "triton"):
        raise ValueError(f"unknown kernel backend {name!r}; use 'auto', 'torch', 'cpu' or 'triton'")
    if name == "cpu" and _cpu is None:
        raise ValueError("the native CPU kernels are not built: call enable_cpu_kernels(cache_dir) first")
    _backend = name


def get_kernel_backend(device: torch.device | None = None) -> Literal["torch", "cpu", "triton"]:
    """The implementation used for inputs on ``device``."""
    if _backend != "auto":
        return _backend
    if device is not None and device.type == "cuda":
        return "triton"
    return "cpu" if _cpu is not None else "torch"


def _use_triton(t: torch.Tensor) -> bool:
    return get_kernel_backend(t.device) == "triton"


def _native(t: torch.Tensor) -> CpuKernels | None:
    """The C kernels when the "cpu" backend serves ``t``'s device."""
    return _cpu if _cpu is not None and get_kernel_backend(t.device) == "cpu" else None


def _cpu_in_use() -> CpuKernels | None:
    """The C kernels when they are built and the backend lets the CPU use them."""
    return _cpu if _cpu is not None and _backend in ("auto", "cpu") else None


def _native_elementwise(t: torch.Tensor) -> CpuElementwise | None:
    native = _native(t)
    return native.elementwise if native is not None else None


def store_kv(
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    slot_idx: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an int8 / fp8 pool
    v_scale: torch.Tensor | None = None,
) -> None:
    """See ``kernels.reference.attention.store_kv``."""
    if _use_triton(k):
        from kernels.triton.store_kv import store_kv as triton_impl

        return triton_impl(k_buffer, v_buffer, k, v, slot_idx, k_scale, v_scale)
    native = _native(k)
    if (native is not None and k_scale is not None and v_scale is not None
            and native.store_kv.supports(k_buffer, k) and native.store_kv.supports(v_buffer, v)):
        return native.store_kv(k_buffer, v_buffer, k, v, slot_idx, k_scale, v_scale)
    return reference.store_kv(k_buffer, v_buffer, k, v, slot_idx, k_scale, v_scale)


def plan_decode(
    page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, shared: Sequence[SharedPrefix] = (),
    window: int | None = None,
) -> AttentionPlan:
    """The torch path's layer-independent part of ``decode_attention`` (one per forward)."""
    return reference.plan_decode(page_table, seq_lens, page_size, shared, window)


def plan_extend(
    page_table: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor, page_size: int, shared: Sequence[SharedPrefix] = (), window: int | None = None,
) -> AttentionPlan:
    """The torch path's layer-independent part of ``extend_attention`` (one per forward)."""
    return reference.plan_extend(page_table, prefix_lens, extend_lens, qo_indptr, page_size, shared, window)


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    page_table: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32
    page_size: int,
    scale: float,
    plan: AttentionPlan | None = None,
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an int8 / fp8 pool
    v_scale: torch.Tensor | None = None,
    window: int | None = None,  # attend to the last ``window`` positions only
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
) -> torch.Tensor:  # [B, Hq, D]
    """See ``kernels.reference.attention.decode_attention``.

    ``plan`` (``plan_decode``, built once per forward pass, with any shared prefixes) only
    changes the cost on the CPU; the Triton kernel reads every page in place and needs
    none. The native CPU kernel reads the pages the plan leaves to each row in place and
    merges the plan's shared prefixes as the reference does. Both kernels take windows
    and soft-caps.
    """
    if _use_triton(q):
        from kernels.triton.decode_attention import decode_attention as triton_impl

        return triton_impl(q, k_buffer, v_buffer, page_table, seq_lens, page_size, scale,
                           k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap)
    native = _native(q)
    if native is not None and native.decode_attention.supports(q, k_buffer):
        if q.shape[0] == 0:
            return torch.empty_like(q)
        plan = plan or reference.plan_decode(page_table, seq_lens, page_size, window=window)
        assert plan.page_table is not None and plan.seq_lens is not None, "not a decode plan"
        out, lse = native.decode_attention(q, k_buffer, v_buffer, plan.page_table, plan.seq_lens,
                                           page_size, scale, k_scale, v_scale, window, softcap)
        reference.merge_shared_prefixes(out, lse, q, plan, k_buffer, v_buffer, scale, k_scale, v_scale, softcap)
        return out
    return reference.decode_attention(q, k_buffer, v_buffer, page_table, seq_lens, page_size, scale,
                                      plan=plan, k_scale=k_scale, v_scale=v_scale, window=window,
                                      softcap=softcap)


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    page_table: torch.Tensor,  # [B, max_pages] int32
    prefix_lens: torch.Tensor,  # [B] int32
    extend_lens: torch.Tensor,  # [B] int32
    qo_indptr: torch.Tensor,  # [B+1] int32
    page_size: int,
    scale: float,
    plan: AttentionPlan | None = None,
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] fp32, for an int8 / fp8 pool
    v_scale: torch.Tensor | None = None,
    window: int | None = None,  # attend to the last ``window`` positions only
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
    invariant: bool = True,  # CPU: rows through the row-invariant C kernel (see below)
) -> torch.Tensor:  # [T, Hq, D]
    """See ``kernels.reference.attention.extend_attention`` (``plan`` and ``window`` as in
    decode, from ``plan_extend``).

    On the CPU with the native kernels, the C kernel (``kernels/cpu/extend_attention.c``)
    when ``invariant`` or for a windowed or soft-capped layer: it reads every page in place
    (``plan`` is not needed), and a row's bits do not depend on the call's other rows or
    keys (docs/invariance.md); torch's SDPA (the reference) is faster on long prompts but
    sums a row by the call's key count. Triton on CUDA (windows and soft-caps too); the
    reference otherwise."""
    if _use_triton(q):
        from kernels.triton.extend_attention import extend_attention as triton_impl

        return triton_impl(
            q, k_buffer, v_buffer, page_table, prefix_lens, extend_lens, qo_indptr, page_size, scale,
            k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap,
        )
    native = _native(q)
    if (native is not None and (invariant or window is not None or softcap is not None)
            and native.extend_attention.supports(q, k_buffer)):
        out, _ = native.extend_attention(q, k_buffer, v_buffer, page_table, prefix_lens, extend_lens, qo_indptr,
                                         page_size, scale, k_scale, v_scale, window, softcap)
        return out
    return reference.extend_attention(
        q, k_buffer, v_buffer, page_table, prefix_lens, extend_lens, qo_indptr, page_size, scale,
        plan=plan, k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap,
    )


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden]
    """See ``kernels.reference.norm.rms_norm``."""
    if _use_triton(x):
        from kernels.triton.rms_norm import rms_norm as triton_impl

        return triton_impl(x, weight, eps)
    native = _native_elementwise(x)
    if native is not None and (out := native.rms_norm(x, weight, eps)) is not None:
        return out
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor,  # [..., hidden], consumed (may be updated in place)
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual)
    """See ``kernels.reference.norm.add_rms_norm``; without a fused kernel, the add and
    then this dispatcher's ``rms_norm`` (Triton on CUDA)."""
    native = _native_elementwise(x)
    if native is not None and (done := native.add_rms_norm(x, residual, weight, eps)) is not None:
        return done
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """See ``kernels.reference.activation.silu_and_mul``."""
    native = _native_elementwise(gate_up)
    if native is not None and (out := native.silu_and_mul(gate_up)) is not None:
        return out
    return reference.silu_and_mul(gate_up)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """See ``kernels.reference.rotary.apply_rotary`` (in place)."""
    native = _native_elementwise(x)
    if native is None or not native.apply_rotary(x, cos, sin):
        reference.apply_rotary(x, cos, sin)


# Batch sizes the C kernel takes on the CPU (figures: docs/benchmarks.md#quant_kernel_crossover,
# from benchmarks/bench_quant_linear.py). Its AVX-512 VNNI path is as fast as dequantizing
# the weight for an fp32 F.linear at 1,024 rows and faster below. Without VNNI the integer
# dot product has no more throughput than an fp32 FMA (AVX2: vpmaddubsw + vpmaddwd share
# one multiply pipe), and above 64 rows the C dequantize (one pass) + fp32 F.linear wins,
# so larger batches there dequantize.
QUANT_KERNEL_MAX_ROWS_WITHOUT_AVX512 = 64
# Where the CPU has AVX512_BF16, oneDNN's bf16 matmul does two multiply-adds per lane and
# instruction at full rate; the kernel's int8 blocks cost a convert and a multiply-add each,
# and a multiply more for a per-block weight scale. From QUANT_BF16_MIN_ROWS rows on (a
# weight with one scale per row: QUANT_BF16_MIN_ROWS_PER_ROW) the weight dequantized to
# bf16 in one C pass + that matmul wins for weights in the row layout. A bf16 copy over
# glibc's largest mmap threshold (32 MiB: the 49152x576 LM head) is a fresh mapping each
# call whose page faults cost more than the matmul saves at small batches, so such a
# weight waits for QUANT_BF16_MIN_ROWS_LARGE rows.
# A tiled weight (AVX-512 VNNI; reference.quant.tile) takes the kernel at every batch: 16
# outputs a vpdpbusd, no horizontal sums, a convert and a multiply-add per 32 inputs of 16
# rows; on the default model's shapes it beats both the row-layout kernel and the bf16
# path at almost every size.
QUANT_BF16_MIN_ROWS = 32
QUANT_BF16_MIN_ROWS_PER_ROW = 64
QUANT_BF16_MIN_ROWS_LARGE = 256
QUANT_BF16_LARGE_BYTES = 32 << 20


def reads_tiles() -> bool:
    """Whether the C kernel in use multiplies tiled weights (a loader can then build the
    tiled layout directly, see ``prepare_quantized``)."""
    native = _cpu_in_use()
    return native is not None and native.quant_linear.tiles


def tile_q4_blocks(rows: np.ndarray, kind: str, in_features: int) -> QuantizedWeight | None:
    """Q4_0 / Q4_1 / Q4_K blocks straight to the tiled layout in one C pass, where the C kernel in
    use reads tiles (``CpuQuantLinear.tile_q4_blocks``; ``rows``: each output row's address);
    None otherwise (the caller has ``reference.quant.tiled_from_q4_blocks``)."""
    native = _cpu_in_use()
    if native is None or not native.quant_linear.tiles:
        return None
    return native.quant_linear.tile_q4_blocks(rows, kind, in_features)


def tile_q6_k_blocks(rows: np.ndarray, in_features: int) -> QuantizedWeight | None:
    """Q6_K blocks straight to the tiled 6-bit layout in one C pass
    (``CpuGGUFRepack.tile_q6_k_blocks``), where the C kernel in use reads tiles; else None."""
    native = _cpu_in_use()
    if native is None or not native.quant_linear.tiles:
        return None
    return native.gguf_repack.tile_q6_k_blocks(rows, in_features)


def tile8_blocks(parts: Sequence[tuple[np.ndarray, str]], in_features: int) -> QuantizedWeight | None:
    """Parts of Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K rows as one tiled 8-bit weight in one C pass
    (``CpuGGUFRepack.tile8_blocks``), where the C kernel in use reads tiles; else None."""
    native = _cpu_in_use()
    if native is None or not native.quant_linear.tiles:
        return None
    return native.gguf_repack.tile8_blocks(parts, in_features)


def tile_q5_blocks(rows: np.ndarray, kind: str, in_features: int) -> QuantizedWeight | None:
    """Q5_0 / Q5_1 blocks straight to the 5-bit tiles in one C pass (as ``tile_q4_blocks``);
    None where the C kernel in use does not read tiles."""
    native = _cpu_in_use()
    if native is None or not native.quant_linear.tiles:
        return None
    return native.quant_linear.tile_q5_blocks(rows, kind, in_features)


def prepare_quantized(weight: QuantizedWeight) -> QuantizedWeight:
    """``weight`` in the layout the C kernel in use multiplies fastest: tiled
    (``reference.quant.tile``) where its build reads tiles (AVX-512 VNNI) and the rows come
    in whole tiles; otherwise ``weight`` itself. Call once, at load."""
    native = _cpu_in_use()
    if (native is None or not native.quant_linear.tiles or weight.tiled or weight.codes.device.type != "cpu"
            or weight.out_features % TILE_ROWS):
        return weight
    return tile(weight)


def quant_kernel_max_rows(weight: QuantizedWeight) -> int | None:
    """The largest batch the C kernel multiplies ``weight`` with on this machine (None:
    every batch, or no C kernel in use); larger batches multiply the dequantized weight
    (``quantized_linear``). The fused decode step, which has only the kernel, takes
    batches up to this size, so both paths compute the same bits."""
    native = _cpu_in_use()
    return None if native is None else _kernel_max_rows(native.quant_linear, weight)


def _kernel_max_rows(kernel: CpuQuantLinear, weight: QuantizedWeight) -> int | None:
    if weight.tiled:
        return None
    if kernel.has_bf16:
        if weight.out_features * weight.in_features * 2 > QUANT_BF16_LARGE_BYTES:
            return QUANT_BF16_MIN_ROWS_LARGE - 1
        return (QUANT_BF16_MIN_ROWS_PER_ROW if weight.num_groups == 1 else QUANT_BF16_MIN_ROWS) - 1
    return None if kernel.path == "avx512-vnni" else QUANT_KERNEL_MAX_ROWS_WITHOUT_AVX512


def quantized_linear(
    x: torch.Tensor,  # [..., K]
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N] float32
    """See ``kernels.reference.quant.quantized_linear``. The C kernel quantizes ``x`` to
    int8 per block of 32 first (llama.cpp's arithmetic; ``reference.quant.quantize_activations``);
    the reference, on other devices (CUDA included) and without the C kernels, dequantizes
    the weight and multiplies in fp32. Batches over ``quant_kernel_max_rows`` dequantize the
    weight in the C kernel's one pass (the reference's bits) and multiply it: in bf16 with
    AVX512_BF16 (``reference.quant.bf16_linear``), in fp32 without AVX-512."""
    native = _native(x)
    if native is None or not native.quant_linear.supports(x, weight):
        return reference.quantized_linear(x, weight, bias)
    kernel = native.quant_linear
    limit = _kernel_max_rows(kernel, weight)
    if limit is None or x.numel() // max(x.shape[-1], 1) <= limit:
        return kernel(x, weight, bias)
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"expected {weight.in_features} input features, got {x.shape[-1]}")
    if kernel.has_bf16:
        return reference.bf16_linear(x, kernel.dequantize(weight, torch.bfloat16), bias)
    return F.linear(x, kernel.dequantize(weight), bias)


def route_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``kernels.reference.moe.route_topk`` (a softmax and a top-k: torch on every device)."""
    return reference.route_topk(logits, top_k, normalize)


def group_by_expert(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """See ``kernels.reference.moe.group_by_expert``."""
    return reference.group_by_expert(weights, ids, num_experts)


def moe_experts(
    x: torch.Tensor,  # [T, H]
    groups: ExpertGroups,
    experts: ExpertWeights,
) -> torch.Tensor:  # [T, H]
    """See ``kernels.reference.moe.moe_experts``: the rows sorted by expert go through the
    Triton grouped GEMM (CUDA, float weights), the C kernel (CPU, quantized weights: its
    int8 activations as in ``quantized_linear``), or one matmul per expert through this
    dispatcher's ``quantized_linear`` / ``F.linear`` and ``silu_and_mul``."""
    x_sorted = x.index_select(0, groups.token_idx)
    if _use_triton(x) and not experts.quantized:
        from kernels.triton.grouped_experts import grouped_experts as triton_impl

        assert isinstance(experts.gate_up, torch.Tensor) and isinstance(experts.down, torch.Tensor)
        rows = triton_impl(x_sorted, groups.offsets, experts.gate_up, experts.down)
    elif (native := _native(x)) is not None and native.moe_experts.supports(x, experts):
        rows = native.moe_experts(x_sorted, groups.offsets, experts)
    else:
        rows = grouped_experts(x_sorted, groups.offsets, experts, _expert_linear, silu_and_mul)
    return combine(rows, groups)


def _expert_linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return quantized_linear(x, weight) if isinstance(weight, QuantizedWeight) else F.linear(x, weight)


def bind_decode_step(weights: DecodeModelWeights, pool: DecodePool) -> BoundDecodeStep:
    """The fused CPU decode step (``kernels/cpu/decode_step.c``) over these weights and this
    pool: a whole decode forward pass in one call. There is no torch or Triton version of
    it; its reference is the layer-by-layer model built from this module's ops.

    Raises:
        UnsupportedDecodeModel: the native CPU kernels are not built or not in use
            (``set_kernel_backend``), or the model / pool is not one the step takes.
    """
    native = _cpu_in_use()
    if native is None:
        raise UnsupportedDecodeModel("the native CPU kernels are not in use")
    return native.decode_step.bind(weights, pool)
