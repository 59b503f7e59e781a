"""The KV tensors behind the page pool: one K and one V buffer per layer.

Layout (what every kernel in ``kernels/`` reads)::

    k[layer], v[layer] : [num_pages * page_size, num_kv_heads, head_dim]
    slot of (page, offset) = page * page_size + offset

Page 0 is the padding page: never handed out, zero-filled, so gathers of padding
positions read finite values.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer K/V buffers of a page pool (allocated once, written in place)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        shape = (self.num_slots, num_kv_heads, head_dim)
        # torch.empty: untouched memory costs nothing until a page is written.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in self.k + self.v:
            buf[:page_size].zero_()  # the padding page

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * elem
