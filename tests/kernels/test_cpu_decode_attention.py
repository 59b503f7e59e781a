"""The native CPU decode-attention kernel (``kernels/cpu``) against the torch reference and
the naive oracle: ragged lengths, GQA groups, page sizes 1 and 16, the vector head sizes
(64, 128) and the scalar fallback, shared-prefix merging, and refused bad tables."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from paged_batch import make_paged_batch, naive_attention, quantize_batch, random_q

import kernels
from kernels import SharedPrefix, dispatch, reference
from kernels.cpu import CpuDecodeAttention, CpuKernels, NativeBuildError

SEQ_LENS = [1, 5, 31, 32, 33, 64, 100, 257]


def _decode_batch(seq_lens: list[int], kv_heads: int, head_dim: int, page_size: int):  # type: ignore[no-untyped-def]
    return make_paged_batch([n - 1 for n in seq_lens], [1] * len(seq_lens), kv_heads, head_dim,
                            page_size, torch.float32)


def _lse(q: torch.Tensor, batch, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[B, Hq] log-sum-exp of each row's scaled scores, walking the page table in Python."""
    rows = []
    for b in range(q.shape[0]):
        n = int(batch.seq_lens[b])
        slots = [int(batch.page_table[b, p // batch.page_size]) * batch.page_size + p % batch.page_size
                 for p in range(n)]
        k = batch.k_buffer[slots].transpose(0, 1)  # [Hkv, n, D]
        k = k.repeat_interleave(q.shape[1] // k.shape[0], dim=0)
        rows.append(torch.logsumexp((q[b][:, None, :] * k).sum(-1) * scale, dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 40)])
def test_matches_reference_and_oracle(
    cpu_decode: CpuDecodeAttention, page_size: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    batch = _decode_batch(SEQ_LENS, kv_heads, head_dim, page_size)
    q = random_q(len(SEQ_LENS), heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    out, lse = cpu_decode(q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens,
                          page_size, scale)
    ref = reference.decode_attention(q, batch.k_buffer, batch.v_buffer, batch.page_table,
                                     batch.seq_lens, page_size, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, naive_attention(q, batch, scale), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, _lse(q, batch, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize(("window", "softcap"), [(1, None), (40, None), (None, 5.0), (300, 2.0)])
def test_windows_and_soft_caps_match_the_oracle(cpu_decode: CpuDecodeAttention, kv_dtype: torch.dtype,
                                                window: int | None, softcap: float | None) -> None:
    """Mistral's window (here also 1: the newest token only; 300: a first partial wholly
    outside the window for the 257-token row) and Gemma 2's soft-cap, over every pool kind;
    through the dispatcher with a windowed plan, the same bits."""
    batch = _decode_batch(SEQ_LENS, 3, 64, 16)
    q = random_q(len(SEQ_LENS), 9, 64, torch.float32) * 3
    plain = batch
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if kv_dtype != torch.float32:
        quant = quantize_batch(batch, kv_dtype)
        batch = dataclasses.replace(batch, k_buffer=quant.k_codes, v_buffer=quant.v_codes)
        plain, scales = quant.dequantized, (quant.k_scale, quant.v_scale)
    out, _ = cpu_decode(q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens, 16, 0.125, *scales,
                        window=window, softcap=softcap)
    torch.testing.assert_close(out, naive_attention(q, plain, 0.125, window, softcap), atol=2e-5, rtol=2e-5)


def test_windowed_dispatch_takes_the_kernel(cpu_kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    batch = _decode_batch(SEQ_LENS, 3, 64, 16)
    q = random_q(len(SEQ_LENS), 9, 64, torch.float32)
    plan = kernels.plan_decode(batch.page_table, batch.seq_lens, 16, window=40)
    got = kernels.decode_attention(q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens, 16, 0.125,
                                   plan, window=40, softcap=3.0)
    want, _ = cpu_kernels.decode_attention(q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens, 16,
                                           0.125, window=40, softcap=3.0)
    assert torch.equal(got, want)


def test_large_scores_and_many_rows(cpu_decode: CpuDecodeAttention) -> None:
    """Scores far from zero (the online softmax rescales) over more rows than threads."""
    seq_lens = [(7 * i) % 300 + 1 for i in range(40)]
    batch = _decode_batch(seq_lens, 3, 64, 16)
    q = random_q(40, 9, 64, torch.float32) * 20
    out, _ = cpu_decode(q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens, 16, 0.125)
    torch.testing.assert_close(out, naive_attention(q, batch, 0.125), atol=1e-4, rtol=1e-4)


def test_empty_rows_and_empty_batch(cpu_decode: CpuDecodeAttention) -> None:
    batch = _decode_batch([3, 4], 1, 64, 1)
    q = random_q(2, 2, 64, torch.float32)
    lens = torch.tensor([0, 4], dtype=torch.int32)
    out, lse = cpu_decode(q, batch.k_buffer, batch.v_buffer, batch.page_table, lens, 1, 0.125)
    assert out[0].abs().sum() == 0 and torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    out, lse = cpu_decode(q[:0], batch.k_buffer, batch.v_buffer, batch.page_table[:0], lens[:0], 1, 0.1)
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)


def test_bad_tables_raise_instead_of_reading_outside_the_pool(cpu_decode: CpuDecodeAttention) -> None:
    batch = _decode_batch([20, 5], 1, 64, 4)
    q = random_q(2, 1, 64, torch.float32)
    args = (q, batch.k_buffer, batch.v_buffer)
    table = batch.page_table.clone()
    table[1, 0] = batch.k_buffer.shape[0] // 4  # one past the last page
    with pytest.raises(ValueError, match="outside"):
        cpu_decode(*args, table, batch.seq_lens, 4, 0.1)
    too_long = torch.tensor([20, 4 * table.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside"):
        cpu_decode(*args, batch.page_table, too_long, 4, 0.1)
    with pytest.raises(ValueError, match="int32"):
        cpu_decode(*args, batch.page_table.long(), batch.seq_lens, 4, 0.1)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_decode(q[:, :, :32], batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens, 4, 0.1)


@pytest.mark.parametrize("page_size", [1, 16])
def test_dispatch_merges_shared_prefixes(
    cpu_kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch, page_size: int
) -> None:
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    seq_lens = [40, 50, 70, 36, 45]
    batch = _decode_batch(seq_lens, 3, 64, page_size)
    pages = 32 // page_size
    table = batch.page_table.clone()
    table[[2, 3], :pages] = table[0, :pages]
    batch = dataclasses.replace(batch, page_table=table)
    shared = [SharedPrefix(table[0, :pages].long(), torch.tensor([0, 2, 3]))]
    q = random_q(5, 9, 64, torch.float32)
    plan = kernels.plan_decode(batch.page_table, batch.seq_lens, page_size, shared)
    out = kernels.decode_attention(q, batch.k_buffer, batch.v_buffer, batch.page_table,
                                   batch.seq_lens, page_size, 0.125, plan)
    torch.testing.assert_close(out, naive_attention(q, batch, 0.125), atol=1e-5, rtol=1e-5)


def test_unsupported_dtype_falls_back_to_the_reference(
    cpu_kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    cpu_decode = cpu_kernels.decode_attention
    batch = make_paged_batch([9], [1], 1, 64, 1, torch.bfloat16)
    q = random_q(1, 2, 64, torch.bfloat16)
    assert not cpu_decode.supports(q, batch.k_buffer)
    out = kernels.decode_attention(q, batch.k_buffer, batch.v_buffer, batch.page_table,
                                   batch.seq_lens, 1, 0.125)
    ref = reference.decode_attention(q, batch.k_buffer, batch.v_buffer, batch.page_table,
                                     batch.seq_lens, 1, 0.125)
    torch.testing.assert_close(out, ref)


def test_build_is_cached_and_failures_are_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_decode: CpuDecodeAttention
) -> None:
    CpuDecodeAttention(tmp_path)
    built = sorted(tmp_path.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    mtime = built[0].stat().st_mtime_ns
    CpuDecodeAttention(tmp_path)  # loads the cached library, no second build
    assert sorted(tmp_path.iterdir()) == built and built[0].stat().st_mtime_ns == mtime
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with pytest.raises(NativeBuildError, match="false failed"):
        CpuDecodeAttention(tmp_path / "other")
    assert not list((tmp_path / "other").iterdir())  # no half-written library left behind
