"""Triton ``store_kv`` against the torch reference, in Triton's interpreter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import reference


@pytest.mark.parametrize(
    ("src_dtype", "pool_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.float32, torch.float16),
    ],
)
def test_store_kv_writes_the_same_pool_as_the_reference(
    triton_kernels: SimpleNamespace, src_dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    num_slots, num_kv_heads, head_dim = 64, 3, 40  # 3 heads and 40 dims: both padded blocks
    pool = torch.randn((num_slots, num_kv_heads, head_dim), generator=gen).to(pool_dtype)
    # k and v sliced out of a fused [T, Hq + 2 Hkv, D] projection, as the model produces them.
    qkv = torch.randn((9, 4 + 2 * num_kv_heads, head_dim), generator=gen).to(src_dtype)
    k, v = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]
    slot_idx = torch.randperm(num_slots, generator=gen)[:9]  # scrambled, distinct

    k_expected, v_expected = pool.clone(), pool.clone()
    reference.store_kv(k_expected, v_expected, k, v, slot_idx)
    k_buffer, v_buffer = pool.clone(), pool.clone()
    triton_kernels.store_kv(k_buffer, v_buffer, k, v, slot_idx.to(torch.int32))

    assert torch.equal(k_buffer, k_expected)
    assert torch.equal(v_buffer, v_expected)


def test_store_kv_with_no_tokens_leaves_the_pool_alone(triton_kernels: SimpleNamespace) -> None:
    k_buffer, v_buffer = torch.ones(8, 2, 16), torch.ones(8, 2, 16)
    empty = torch.empty(0, 2, 16)
    triton_kernels.store_kv(k_buffer, v_buffer, empty, empty, torch.empty(0, dtype=torch.int64))
    assert torch.equal(k_buffer, torch.ones(8, 2, 16)) and torch.equal(
        v_buffer, torch.ones(8, 2, 16)
    )
