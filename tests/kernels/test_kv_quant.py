"""The 8-bit KV cache (int8 and fp8 e4m3 codes with per-(token, head) scales): the
quantization spec, the torch reference over a quantized pool, and the native CPU decode
kernel against both (the Triton kernels: ``test_triton_attention.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_batch import make_paged_batch, naive_attention, quantize_batch, random_q

import kernels
from kernels import SharedPrefix, dequantize_kv, dispatch, quantize_kv, reference
from kernels.cpu import CpuDecodeAttention, CpuKernels

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]
SEQ_LENS = [1, 5, 31, 32, 33, 64, 100, 257]


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_quantize_round_trip_error_is_bounded_per_row(dtype: torch.dtype) -> None:
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]  # rows of any range
    codes, scale = quantize_kv(x, dtype)
    assert codes.dtype == dtype and scale.shape == (50, 3) and scale.dtype == torch.float32
    err = (dequantize_kv(codes, scale) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        assert (err <= scale[..., None] * 0.5 + 1e-6 * amax).all()  # half a quantum
        assert codes.abs().amax(-1).eq(127).all()  # each row uses the full range
    else:  # e4m3: 3 mantissa bits -> relative error <= 2^-4 (normals), absolute near zero
        assert (err <= x.abs() / 16 + scale[..., None] * 2.0**-9 + 1e-6 * amax).all()


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_zero_rows_quantize_to_zero(dtype: torch.dtype) -> None:
    codes, scale = quantize_kv(torch.zeros(2, 1, 8), dtype)
    assert (scale == 1).all() and (dequantize_kv(codes, scale) == 0).all()


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_store_kv_writes_codes_and_scales(dtype: torch.dtype) -> None:
    k_buf, v_buf = torch.zeros(10, 2, 16, dtype=dtype), torch.zeros(10, 2, 16, dtype=dtype)
    k_scale, v_scale = torch.zeros(10, 2), torch.zeros(10, 2)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([7, 2, 5])
    reference.store_kv(k_buf, v_buf, k, v, slots, k_scale, v_scale)
    for buf, scales, x in ((k_buf, k_scale, k), (v_buf, v_scale, v)):
        codes, scale = quantize_kv(x, dtype)
        assert torch.equal(buf[slots].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(scales[slots], scale)
        assert (buf[[0, 1, 3]].float() == 0).all()
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        reference.store_kv(k_buf, v_buf, k, v, slots)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_reference_attention_reads_the_dequantized_pool(dtype: torch.dtype, page_size: int) -> None:
    """Decode and extend over codes + scales equal plain attention over their fp32 values."""
    batch = make_paged_batch([0, 7, 40], [5, 1, 20], 3, 64, page_size, torch.float32)
    qb = quantize_batch(batch, dtype)
    q = random_q(int(batch.extend_lens.sum()), 9, 64, torch.float32)
    out = reference.extend_attention(q, qb.k_codes, qb.v_codes, batch.page_table, batch.prefix_lens,
                                     batch.extend_lens, batch.qo_indptr, page_size, 0.125,
                                     k_scale=qb.k_scale, v_scale=qb.v_scale)
    torch.testing.assert_close(out, naive_attention(q, qb.dequantized, 0.125), atol=1e-5, rtol=1e-5)
    dec = make_paged_batch([n - 1 for n in SEQ_LENS], [1] * len(SEQ_LENS), 3, 64, page_size, torch.float32)
    qd = quantize_batch(dec, dtype)
    q = random_q(len(SEQ_LENS), 9, 64, torch.float32)
    out = reference.decode_attention(q, qd.k_codes, qd.v_codes, dec.page_table, dec.seq_lens, page_size,
                                     0.125, k_scale=qd.k_scale, v_scale=qd.v_scale)
    torch.testing.assert_close(out, naive_attention(q, qd.dequantized, 0.125), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="scales"):
        reference.decode_attention(q, qd.k_codes, qd.v_codes, dec.page_table, dec.seq_lens, page_size, 0.125)


def test_int8_attention_stays_close_to_fp32() -> None:
    """What the quantization costs one attention call: a small error, not a different result."""
    batch = make_paged_batch([n - 1 for n in SEQ_LENS], [1] * len(SEQ_LENS), 3, 64, 16, torch.float32)
    q = random_q(len(SEQ_LENS), 9, 64, torch.float32) * 3
    exact = naive_attention(q, batch, 0.125)
    approx = naive_attention(q, quantize_batch(batch, torch.int8).dequantized, 0.125)
    err = (approx - exact).abs()  # outputs are O(1): V rows ~ N(0, 1)
    assert err.max() < 0.06 and err.mean() < 0.01


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 40)])
def test_cpu_kernel_matches_reference_on_quantized_pool(
    cpu_decode: CpuDecodeAttention, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int,
    head_dim: int,
) -> None:
    batch = make_paged_batch([n - 1 for n in SEQ_LENS], [1] * len(SEQ_LENS), kv_heads, head_dim,
                             page_size, torch.float32)
    qb = quantize_batch(batch, dtype)
    q = random_q(len(SEQ_LENS), heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    out, lse = cpu_decode(q, qb.k_codes, qb.v_codes, batch.page_table, batch.seq_lens, page_size, scale,
                          qb.k_scale, qb.v_scale)
    ref = reference.decode_attention(q, qb.k_codes, qb.v_codes, batch.page_table, batch.seq_lens,
                                     page_size, scale, k_scale=qb.k_scale, v_scale=qb.v_scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    plain, plain_lse = cpu_decode(q, qb.dequantized.k_buffer, qb.dequantized.v_buffer, batch.page_table,
                                  batch.seq_lens, page_size, scale)
    torch.testing.assert_close(lse, plain_lse, atol=1e-5, rtol=1e-5)


def test_cpu_kernel_decodes_every_fp8_code(cpu_decode: CpuDecodeAttention) -> None:
    """All 254 finite e4m3 codes (subnormals included), read through the kernel's table:
    with one token per request the output is that token's V row exactly."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes == 0x7F] = 0
    codes[codes == 0xFF] = 0  # the two NaN codes
    v = codes.view(torch.float8_e4m3fn).reshape(32, 1, 8)  # 32 one-token requests, D = 8
    k = torch.zeros_like(v)
    scales = torch.full((32, 1), 0.5)
    table = torch.arange(32, dtype=torch.int32)[:, None]
    out, _ = cpu_decode(torch.ones(32, 1, 8), k, v, table, torch.ones(32, dtype=torch.int32), 1, 1.0,
                        scales, scales)
    assert torch.equal(out, v.float() * 0.5)


def test_cpu_kernel_refuses_missing_or_bad_scales(cpu_decode: CpuDecodeAttention) -> None:
    batch = make_paged_batch([9], [1], 1, 64, 1, torch.float32)
    qb = quantize_batch(batch, torch.int8)
    q = random_q(1, 2, 64, torch.float32)
    args = (q, qb.k_codes, qb.v_codes, batch.page_table, batch.seq_lens, 1, 0.125)
    with pytest.raises(ValueError, match="k_scale"):
        cpu_decode(*args)
    with pytest.raises(ValueError, match="v_scale"):
        cpu_decode(*args, qb.k_scale, qb.v_scale.double())
    with pytest.raises(ValueError, match="both alike"):
        cpu_decode(q, qb.k_codes, qb.dequantized.v_buffer, batch.page_table, batch.seq_lens, 1, 0.125)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_dispatch_merges_shared_prefixes_on_quantized_pool(
    cpu_kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    batch = make_paged_batch([39, 49, 69, 35, 44], [1] * 5, 3, 64, 16, torch.float32)
    table = batch.page_table.clone()
    table[[2, 3], :2] = table[0, :2]
    batch = dataclasses.replace(batch, page_table=table)
    qb = quantize_batch(batch, dtype)
    shared = [SharedPrefix(table[0, :2].long(), torch.tensor([0, 2, 3]))]
    q = random_q(5, 9, 64, torch.float32)
    plan = kernels.plan_decode(batch.page_table, batch.seq_lens, 16, shared)
    out = kernels.decode_attention(q, qb.k_codes, qb.v_codes, batch.page_table, batch.seq_lens, 16,
                                   0.125, plan, qb.k_scale, qb.v_scale)
    torch.testing.assert_close(out, naive_attention(q, qb.dequantized, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_cpu_store_kv_writes_the_reference_codes_and_scales(cpu_kernels: CpuKernels, dtype: torch.dtype) -> None:
    """Bit for bit, on rows of every range (fp8 subnormals and mantissa carries included),
    from k / v slices of a fused projection (a token stride wider than the heads)."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(40, 4 + 2 * 3, 64, generator=gen) * torch.logspace(-4, 4, 40)[:, None, None]
    k, v = qkv[:, 4:7], qkv[:, 7:]
    k[0, 1] = 0.0
    slots = torch.randperm(64, generator=gen)[:40]
    pools = [[torch.zeros(64, 3, 64, dtype=dtype) for _ in range(2)] + [torch.zeros(64, 3) for _ in range(2)]
             for _ in range(2)]
    reference.store_kv(pools[0][0], pools[0][1], k, v, slots, pools[0][2], pools[0][3])
    cpu_kernels.store_kv(pools[1][0], pools[1][1], k, v, slots, pools[1][2], pools[1][3])
    for expected, got in zip(pools[0], pools[1], strict=True):
        assert torch.equal(got.view(torch.uint8) if got.dtype == dtype else got,
                           expected.view(torch.uint8) if expected.dtype == dtype else expected)
    with pytest.raises(ValueError, match="outside"):
        cpu_kernels.store_kv(*pools[1][:2], k[:1], v[:1], torch.tensor([64]), *pools[1][2:])


def test_dispatch_stores_through_the_native_kernel(cpu_kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    calls = []
    monkeypatch.setattr(type(cpu_kernels.store_kv), "__call__", lambda self, *a: calls.append(a))
    buf = torch.zeros(4, 1, 8, dtype=torch.int8)
    kernels.store_kv(buf, buf.clone(), torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.tensor([1]),
                     torch.zeros(4, 1), torch.zeros(4, 1))
    assert len(calls) == 1
