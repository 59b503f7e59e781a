"""The KV tensors behind the page pool: one K and one V buffer per layer.

Layout (what every kernel in ``kernels/`` reads)::

    k[layer], v[layer]             : [num_pages * page_size, num_kv_heads, head_dim]
    k_scale[layer], v_scale[layer] : [num_pages * page_size, num_kv_heads] fp32
                                     (int8 / fp8 pools only; None otherwise)
    slot of (page, offset) = page * page_size + offset

An int8 / fp8 e4m3 pool stores each (token, head) row as 8-bit codes with one fp32 scale
beside it, ``x ~= code * scale`` (``kernels.reference.kv_quant``): 68 bytes per row of 64
values instead of 256 in fp32, so the same memory holds ~3.8x the tokens. Scales live in
the same slots as their rows, so pages stay pages: the page pool, the radix tree and
retraction never know the difference.

Page 0 is the padding page: never handed out, zero-filled (codes and scales), so gathers
of padding positions read finite values.
"""

from __future__ import annotations

import torch

from kernels import is_quantized_kv


class KVCache:
    """Per-layer K/V buffers of a page pool (allocated once, written in place)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,  # the stored dtype: the model's, or torch.int8 / float8_e4m3fn
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.dtype = dtype
        self.num_slots = num_pages * page_size
        shape = (self.num_slots, num_kv_heads, head_dim)
        # torch.empty: untouched memory costs nothing until a page is written.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_scale: list[torch.Tensor] | None = None
        self.v_scale: list[torch.Tensor] | None = None
        if is_quantized_kv(dtype):
            scale_shape = (self.num_slots, num_kv_heads)
            self.k_scale = [torch.empty(scale_shape, dtype=torch.float32, device=device)
                            for _ in range(num_layers)]
            self.v_scale = [torch.empty(scale_shape, dtype=torch.float32, device=device)
                            for _ in range(num_layers)]
        for buf in self.k + self.v + (self.k_scale or []) + (self.v_scale or []):
            buf[:page_size].zero_()  # the padding page

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(k, v, k_scale, v_scale) of layer ``idx``; the scales are None unless quantized."""
        if self.k_scale is None or self.v_scale is None:
            return self.k[idx], self.v[idx], None, None
        return self.k[idx], self.v[idx], self.k_scale[idx], self.v_scale[idx]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x (head_dim x bytes per element + the row's
        scale: 4 bytes in an int8 / fp8 pool, none otherwise)."""
        elem = torch.empty((), dtype=dtype).element_size()
        scale = 4 if is_quantized_kv(dtype) else 0
        return 2 * num_layers * num_kv_heads * (head_dim * elem + scale)
