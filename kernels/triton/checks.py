"""Argument checks shared by the Triton wrappers.

Every wrapper validates shapes, dtypes, devices and strides on the host before it launches,
so a bad call fails with a ``ValueError`` that names the argument instead of a silent
out-of-bounds read on the GPU. None of these checks synchronizes with the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
QUANT_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)  # 8-bit pools, with row scales

# A dimension spec: an exact size, or None for "any size".
Dim = int | None


def check_tensor(
    name: str,
    t: object,
    shape: Sequence[Dim],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
) -> torch.Tensor:
    """Check one argument; returns it typed as a tensor.

    Raises:
        ValueError: ``t`` is not a tensor, or its rank, sizes, dtype or device differ from the
            spec, or its last dimension is not contiguous (stride 1).
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(t.shape, shape, strict=True)
    ):
        spec = ", ".join("*" if d is None else str(d) for d in shape)
        raise ValueError(f"{name} must have shape [{spec}], got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {list(dtypes)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return t


def check_pool(
    k_buffer: object, v_buffer: object, k_scale: object = None, v_scale: object = None
) -> tuple[torch.device, tuple[int, int, int]]:
    """Check a layer's K and V pool buffers (and an 8-bit pool's row scales, which it
    requires); returns their device and (num_slots, Hkv, D)."""
    if not isinstance(k_buffer, torch.Tensor):
        raise ValueError(f"k_buffer must be a torch.Tensor, got {type(k_buffer).__name__}")
    device = k_buffer.device
    check_tensor("k_buffer", k_buffer, (None, None, None), FLOAT_DTYPES + QUANT_KV_DTYPES, device)
    num_slots, num_kv_heads, head_dim = (int(n) for n in k_buffer.shape)
    check_tensor("v_buffer", v_buffer, k_buffer.shape, (k_buffer.dtype,), device)
    if k_buffer.dtype in QUANT_KV_DTYPES:
        for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scales is None:
                raise ValueError(f"a {k_buffer.dtype} KV pool needs {name} [num_slots, Hkv] fp32")
            check_tensor(name, scales, (num_slots, num_kv_heads), (torch.float32,), device)
            if not scales.is_contiguous():  # type: ignore[attr-defined]
                raise ValueError(f"{name} must be contiguous")
    return device, (num_slots, num_kv_heads, head_dim)


def check_launchable(device: torch.device, kernel: object) -> None:
    """Triton runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``."""
    if device.type != "cuda" and not is_interpreted(kernel):
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {device}; use the torch reference "
            "(set_kernel_backend('torch')) or run with TRITON_INTERPRET=1"
        )


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was jitted under ``TRITON_INTERPRET=1`` (runs on the CPU)."""
    return type(kernel).__name__ == "InterpretedFunction"


def dot_config(q_dtype: torch.dtype, kv_dtype: torch.dtype, kernel: object) -> dict[str, object]:
    """The attention kernels' ``DOT_FP32`` / ``DOT_PRECISION`` constexprs.

    fp32 inputs get exact fp32 dots (not TF32), mixed q/KV dtypes meet in fp32, and the
    interpreter's bf16 ``tl.dot`` is wrong (Triton 3.9), so bf16 goes through fp32 there.
    16-bit dots keep Triton's default precision (``None``).
    """
    fp32 = (
        q_dtype == torch.float32
        or q_dtype != kv_dtype
        or (q_dtype == torch.bfloat16 and is_interpreted(kernel))
    )
    return {"DOT_FP32": fp32, "DOT_PRECISION": "ieee" if fp32 else None}


def block_size(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= ``n`` and >= ``minimum`` (``tl.dot`` needs 16)."""
    return max(minimum, int(triton.next_power_of_2(max(n, 1))))


def scale_args(
    k_buffer: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale pointers a kernel takes: an 8-bit pool's (checked by ``check_pool``), or
    the pool itself as a placeholder that a kernel with ``QUANT=False`` never reads.
    Scales beside a float pool are refused rather than ignored."""
    if k_buffer.dtype not in QUANT_KV_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale belong to an 8-bit KV pool, not {k_buffer.dtype}")
        return k_buffer, k_buffer
    assert k_scale is not None and v_scale is not None
    return k_scale, v_scale
