"""The native CPU prefill ("extend") attention kernel: against the naive oracle (causal,
GQA, ragged prefixes, windows, soft-caps, page sizes 1 and 16, the vector head sizes and
the scalar fallback, 8-bit pools), and row invariance: a row's bits are the same whatever
else the call holds (one call, chunks, other requests) and equal to the decode kernel's
for that token."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_batch import PagedBatch, make_paged_batch, naive_attention, quantize_batch, random_q

import kernels
from kernels import dispatch
from kernels.cpu import CpuExtendAttention, CpuKernels

PREFIXES = [0, 3, 40, 0, 300]
EXTENDS = [1, 29, 70, 33, 20]


@pytest.fixture(scope="module")
def cpu_extend(cpu_kernels: CpuKernels) -> CpuExtendAttention:
    return cpu_kernels.extend_attention


def _run(kernel: CpuExtendAttention, q: torch.Tensor, batch: PagedBatch, scale: float,
         **kw: object) -> torch.Tensor:
    out, _ = kernel(q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.prefix_lens, batch.extend_lens,
                    batch.qo_indptr, batch.page_size, scale, **kw)  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (4, 2, 16), (8, 2, 40)])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (24, None), (None, 5.0), (37, 2.0)])
def test_matches_the_oracle(cpu_extend: CpuExtendAttention, page_size: int, heads: int, kv_heads: int,
                            head_dim: int, window: int | None, softcap: float | None) -> None:
    batch = make_paged_batch(PREFIXES, EXTENDS, kv_heads, head_dim, page_size, torch.float32)
    q = random_q(sum(EXTENDS), heads, head_dim, torch.float32) * 2
    scale = head_dim**-0.5
    out = _run(cpu_extend, q, batch, scale, window=window, softcap=softcap)
    want = naive_attention(q, batch, scale, window=window, softcap=softcap)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_reads_an_8bit_pool(cpu_extend: CpuExtendAttention, dtype: torch.dtype) -> None:
    batch = make_paged_batch(PREFIXES, EXTENDS, 3, 64, 16, torch.float32)
    quant = quantize_batch(batch, dtype)
    q = random_q(sum(EXTENDS), 9, 64, torch.float32)
    out, _ = cpu_extend(q, quant.k_codes, quant.v_codes, batch.page_table, batch.prefix_lens, batch.extend_lens,
                        batch.qo_indptr, 16, 0.125, quant.k_scale, quant.v_scale, window=50)
    want = naive_attention(q, quant.dequantized, 0.125, window=50)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def _one_request(batch: PagedBatch, b: int, start: int, count: int) -> PagedBatch:
    """Request ``b``'s new tokens ``start .. start + count - 1`` alone (the rest as cached prefix)."""
    return dataclasses.replace(
        batch, page_table=batch.page_table[b : b + 1],
        prefix_lens=torch.tensor([int(batch.prefix_lens[b]) + start], dtype=torch.int32),
        extend_lens=torch.tensor([count], dtype=torch.int32), qo_indptr=torch.tensor([0, count], dtype=torch.int32))


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (45, 3.0)])
def test_a_rows_bits_do_not_depend_on_the_call(cpu_kernels: CpuKernels, window: int | None,
                                               softcap: float | None) -> None:
    """Each request's rows from the batched call = from calls of that request alone, cut
    into chunks of 7 tokens (off every block boundary) = the decode kernel's, token by
    token: equal, not close."""
    extend, decode = cpu_kernels.extend_attention, cpu_kernels.decode_attention
    batch = make_paged_batch(PREFIXES, EXTENDS, 3, 64, 16, torch.float32)
    q = random_q(sum(EXTENDS), 9, 64, torch.float32)
    whole = _run(extend, q, batch, 0.125, window=window, softcap=softcap)
    for b, (prefix, ext) in enumerate(zip(PREFIXES, EXTENDS, strict=True)):
        rows = q[int(batch.qo_indptr[b]) : int(batch.qo_indptr[b + 1])]
        chunks = [_run(extend, rows[s : s + 7], _one_request(batch, b, s, min(7, ext - s)), 0.125, window=window,
                       softcap=softcap) for s in range(0, ext, 7)]
        assert torch.equal(torch.cat(chunks), whole[int(batch.qo_indptr[b]) : int(batch.qo_indptr[b + 1])])
        lens = torch.arange(prefix + 1, prefix + ext + 1, dtype=torch.int32)
        table = batch.page_table[b : b + 1].expand(ext, -1).contiguous()
        one_by_one, _ = decode(rows, batch.k_buffer, batch.v_buffer, table, lens, 16, 0.125,
                               window=window, softcap=softcap)
        assert torch.equal(one_by_one, torch.cat(chunks))


def test_empty_calls_and_bad_inputs(cpu_extend: CpuExtendAttention) -> None:
    batch = make_paged_batch([4, 0], [3, 5], 1, 64, 4, torch.float32)
    q = random_q(8, 2, 64, torch.float32)
    args = (batch.k_buffer, batch.v_buffer)
    none = torch.zeros(0, dtype=torch.int32)
    out, lse = cpu_extend(q[:0], *args, batch.page_table[:0], none, none, torch.zeros(1, dtype=torch.int32), 4, 0.1)
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)
    table = batch.page_table.clone()
    table[1, 0] = batch.k_buffer.shape[0] // 4  # one past the last page
    with pytest.raises(ValueError, match="outside"):
        cpu_extend(q, *args, table, batch.prefix_lens, batch.extend_lens, batch.qo_indptr, 4, 0.1)
    with pytest.raises(ValueError, match="outside"):  # the offsets do not add up to the lengths
        cpu_extend(q, *args, batch.page_table, batch.prefix_lens, batch.extend_lens,
                   torch.tensor([0, 2, 8], dtype=torch.int32), 4, 0.1)
    with pytest.raises(ValueError, match="int32"):
        cpu_extend(q, *args, batch.page_table.long(), batch.prefix_lens, batch.extend_lens, batch.qo_indptr, 4, 0.1)
    with pytest.raises(ValueError, match="window must be >= 1"):
        cpu_extend(q, *args, batch.page_table, batch.prefix_lens, batch.extend_lens, batch.qo_indptr, 4, 0.1,
                   window=0)
    with pytest.raises(ValueError, match="soft-cap must be > 0"):
        cpu_extend(q, *args, batch.page_table, batch.prefix_lens, batch.extend_lens, batch.qo_indptr, 4, 0.1,
                   softcap=-1.0)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (24, 4.0)])
def test_dispatch_takes_the_kernel_on_the_cpu(cpu_kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch,
                                              window: int | None, softcap: float | None) -> None:
    """``kernels.extend_attention`` runs the C kernel (its bits) with the native kernels on,
    a plan with shared prefixes included (the kernel reads every page itself)."""
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    batch = make_paged_batch(PREFIXES, EXTENDS, 3, 64, 16, torch.float32)
    q = random_q(sum(EXTENDS), 9, 64, torch.float32)
    plan = kernels.plan_extend(batch.page_table, batch.prefix_lens, batch.extend_lens, batch.qo_indptr, 16,
                               window=window)
    got = kernels.extend_attention(q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.prefix_lens,
                                   batch.extend_lens, batch.qo_indptr, 16, 0.125, plan, window=window,
                                   softcap=softcap)
    assert torch.equal(got, _run(cpu_kernels.extend_attention, q, batch, 0.125, window=window, softcap=softcap))


def test_not_invariant_takes_torch_except_for_windows_and_caps(cpu_kernels: CpuKernels,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``invariant=False`` (``--no-invariant-attention``): plain layers take torch's SDPA
    (the reference's bits), windowed or soft-capped ones still the C kernel."""
    from kernels import reference

    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    batch = make_paged_batch(PREFIXES, EXTENDS, 3, 64, 16, torch.float32)
    q = random_q(sum(EXTENDS), 9, 64, torch.float32)
    args = (q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.prefix_lens, batch.extend_lens,
            batch.qo_indptr, 16, 0.125)
    plain = kernels.extend_attention(*args, invariant=False)
    assert torch.equal(plain, reference.extend_attention(*args))
    assert not torch.equal(plain, _run(cpu_kernels.extend_attention, q, batch, 0.125))
    capped = kernels.extend_attention(*args, softcap=4.0, invariant=False)
    assert torch.equal(capped, _run(cpu_kernels.extend_attention, q, batch, 0.125, softcap=4.0))
