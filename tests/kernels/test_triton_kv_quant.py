"""The Triton kernels over an 8-bit KV pool (int8 / fp8 e4m3 codes with row scales)
against the torch reference, in Triton's interpreter, on small shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from paged_batch import make_paged_batch, quantize_batch, random_q

from kernels import reference

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_store_kv_writes_the_reference_codes_and_scales(triton_kernels: SimpleNamespace, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_slots, num_kv_heads, head_dim = 32, 3, 40  # padded blocks on both axes
    k = torch.randn((9, num_kv_heads, head_dim), generator=gen) * 3
    v = torch.randn((9, num_kv_heads, head_dim), generator=gen)
    k[0, 1] = 0.0  # an all-zero row: scale 1, codes 0
    slot_idx = torch.randperm(num_slots, generator=gen)[:9]
    pools = [[torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype) for _ in range(2)]
             + [torch.zeros(num_slots, num_kv_heads) for _ in range(2)] for _ in range(2)]
    reference.store_kv(pools[0][0], pools[0][1], k, v, slot_idx, pools[0][2], pools[0][3])
    triton_kernels.store_kv(pools[1][0], pools[1][1], k, v, slot_idx.to(torch.int32),
                            pools[1][2], pools[1][3])
    for expected, got in zip(pools[0], pools[1], strict=True):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           expected.view(torch.uint8) if expected.dtype == torch.float8_e4m3fn else expected)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_and_extend_match_reference(
    triton_kernels: SimpleNamespace, dtype: torch.dtype, page_size: int
) -> None:
    dec = make_paged_batch([0, 5, 15, 34, 69], [1] * 5, 2, 64, page_size, torch.float32)
    qd = quantize_batch(dec, dtype)
    q = random_q(5, 6, 64, torch.float32)
    scales = {"k_scale": qd.k_scale, "v_scale": qd.v_scale}
    args = (q, qd.k_codes, qd.v_codes, dec.page_table, dec.seq_lens, page_size, 0.125)
    torch.testing.assert_close(triton_kernels.decode_attention(*args, **scales),
                               reference.decode_attention(*args, **scales), atol=1e-5, rtol=1e-5)
    ext = make_paged_batch([0, 5, 16, 33], [7, 1, 20, 70], 2, 64, page_size, torch.float32)
    qe = quantize_batch(ext, dtype)
    q = random_q(98, 6, 64, torch.float32)
    scales = {"k_scale": qe.k_scale, "v_scale": qe.v_scale}
    args = (q, qe.k_codes, qe.v_codes, ext.page_table, ext.prefix_lens, ext.extend_lens, ext.qo_indptr,
            page_size, 0.125)
    torch.testing.assert_close(triton_kernels.extend_attention(*args, **scales),
                               reference.extend_attention(*args, **scales), atol=1e-5, rtol=1e-5)


def test_scales_are_required_by_an_8bit_pool_and_refused_by_a_float_one(
    triton_kernels: SimpleNamespace,
) -> None:
    batch = make_paged_batch([4], [1], 1, 16, 1, torch.float32)
    qb = quantize_batch(batch, torch.int8)
    q = random_q(1, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="needs k_scale"):
        triton_kernels.decode_attention(q, qb.k_codes, qb.v_codes, batch.page_table, batch.seq_lens, 1, 0.25)
    with pytest.raises(ValueError, match="8-bit KV pool"):
        triton_kernels.decode_attention(q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens,
                                        1, 0.25, k_scale=qb.k_scale, v_scale=qb.v_scale)
