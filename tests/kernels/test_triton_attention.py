"""Triton decode / extend attention against the torch reference, in Triton's interpreter.

Pools come from ``paged_batch``: scrambled page order, NaN in spare pages, garbage in the
page-table padding, so a kernel that reads outside a request's pages fails loudly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from paged_batch import PagedBatch, make_paged_batch, random_q

from kernels import reference

GQA = [(2, 1), (2, 3), (1, 8)]  # (num_kv_heads, query heads per KV head)
# Every page size x GQA ratio in fp32; fp16 on a spread of them (the interpreter is slow).
CASE_NAMES = ("page_size", "num_kv_heads", "group", "dtype")
CASES = [(p, h, g, torch.float32) for p in (1, 16) for h, g in GQA] + [
    (16, 2, 1, torch.float16),
    (16, 2, 3, torch.float16),
    (1, 1, 8, torch.float16),
]
CASE_IDS = [f"page{p}-kv{h}-gqa{g}-{str(d).removeprefix('torch.')}" for p, h, g, d in CASES]
TOLERANCE = {  # (atol, rtol) against the torch reference, both in the input dtype
    torch.float32: (1e-5, 1e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def _decode_batch(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
) -> PagedBatch:
    """A decode batch: each request's newest token is already in the pool."""
    return make_paged_batch(
        [n - 1 for n in seq_lens], [1] * len(seq_lens), num_kv_heads, head_dim, page_size, dtype
    )


def _check_decode(ops: SimpleNamespace, batch: PagedBatch, q: torch.Tensor, **kwargs: int) -> None:
    args = (
        q,
        batch.k_buffer,
        batch.v_buffer,
        batch.page_table,
        batch.seq_lens,
        batch.page_size,
        q.shape[-1] ** -0.5,
    )
    out = ops.decode_attention(*args, **kwargs)
    expected = reference.decode_attention(*args)
    atol, rtol = TOLERANCE[q.dtype]
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def _check_extend(ops: SimpleNamespace, batch: PagedBatch, q: torch.Tensor) -> None:
    args = (
        q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.prefix_lens,
        batch.extend_lens, batch.qo_indptr, batch.page_size, q.shape[-1] ** -0.5,
    )  # fmt: skip
    out = ops.extend_attention(*args)
    expected = reference.extend_attention(*args)
    atol, rtol = TOLERANCE[q.dtype]
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize(CASE_NAMES, CASES, ids=CASE_IDS)
def test_decode_matches_reference(
    triton_kernels: SimpleNamespace,
    page_size: int,
    num_kv_heads: int,
    group: int,
    dtype: torch.dtype,
) -> None:
    seq_lens = [1, 6, 16, 35, 70]  # ragged, mostly not multiples of the page size
    batch = _decode_batch(seq_lens, num_kv_heads, 64, page_size, dtype)
    _check_decode(triton_kernels, batch, random_q(len(seq_lens), num_kv_heads * group, 64, dtype))


@pytest.mark.parametrize(CASE_NAMES, CASES, ids=CASE_IDS)
def test_extend_matches_reference(
    triton_kernels: SimpleNamespace,
    page_size: int,
    num_kv_heads: int,
    group: int,
    dtype: torch.dtype,
) -> None:
    # Empty prefix, 1-token extend, page-aligned prefix, and 70 new tokens (2 query tiles).
    prefix_lens, extend_lens = [0, 5, 16, 33], [7, 1, 20, 70]
    batch = make_paged_batch(prefix_lens, extend_lens, num_kv_heads, 64, page_size, dtype)
    _check_extend(
        triton_kernels, batch, random_q(sum(extend_lens), num_kv_heads * group, 64, dtype)
    )


def test_decode_long_context_uses_several_splits(triton_kernels: SimpleNamespace) -> None:
    from kernels.triton.decode_attention import choose_num_splits

    batch = _decode_batch(
        [1000, 37], num_kv_heads=1, head_dim=32, page_size=16, dtype=torch.float32
    )
    capacity = batch.page_table.shape[1] * batch.page_size
    assert choose_num_splits(2, 1, capacity, torch.device("cpu")) > 1
    q = random_q(2, 4, 32, torch.float32)
    _check_decode(triton_kernels, batch, q)  # the automatic choice


@pytest.mark.parametrize("num_kv_splits", [1, 3, 16])
def test_decode_any_split_count_gives_the_same_result(
    triton_kernels: SimpleNamespace, num_kv_splits: int
) -> None:
    # With 16 splits the 37-token request leaves most splits empty.
    batch = _decode_batch(
        [1000, 37], num_kv_heads=1, head_dim=32, page_size=16, dtype=torch.float32
    )
    _check_decode(
        triton_kernels, batch, random_q(2, 4, 32, torch.float32), num_kv_splits=num_kv_splits
    )


def test_decode_padded_head_dim_bf16_and_int64_indices(triton_kernels: SimpleNamespace) -> None:
    batch = _decode_batch([3, 40], num_kv_heads=2, head_dim=40, page_size=16, dtype=torch.bfloat16)
    batch = PagedBatch(
        batch.k_buffer, batch.v_buffer, batch.page_table.long(), batch.prefix_lens.long(),
        batch.extend_lens.long(), batch.qo_indptr.long(), batch.page_size,
    )  # fmt: skip
    _check_decode(triton_kernels, batch, random_q(2, 4, 40, torch.bfloat16))


def test_extend_padded_head_dim_and_bf16(triton_kernels: SimpleNamespace) -> None:
    batch = make_paged_batch([0, 9], [5, 12], 2, 40, 16, torch.bfloat16)
    _check_extend(triton_kernels, batch, random_q(17, 4, 40, torch.bfloat16))


def test_strided_q_views_are_read_through_their_strides(triton_kernels: SimpleNamespace) -> None:
    # q sliced out of a fused qkv tensor, as the model produces it: rows are not contiguous.
    qkv = random_q(5, 6 + 2 + 2, 64, torch.float32)  # [T, Hq + 2 Hkv, D]
    q = qkv[:, :6]
    assert not q.is_contiguous()
    _check_decode(triton_kernels, _decode_batch([1, 6, 16, 35, 70], 2, 64, 16, torch.float32), q)
    _check_extend(triton_kernels, make_paged_batch([4, 0], [3, 2], 2, 64, 16, torch.float32), q)


def test_fp16_queries_over_fp32_pool_meet_in_fp32(triton_kernels: SimpleNamespace) -> None:
    batch = _decode_batch([9, 21], num_kv_heads=2, head_dim=64, page_size=1, dtype=torch.float32)
    _check_decode(triton_kernels, batch, random_q(2, 4, 64, torch.float16))


@pytest.mark.parametrize(("window", "softcap"), [(1, None), (20, None), (None, 3.0), (30, 2.0)])
def test_decode_windows_and_soft_caps(triton_kernels: SimpleNamespace, window: int | None,
                                      softcap: float | None) -> None:
    """Mistral's window (1: the newest token only) and Gemma 2's soft-cap, over several
    splits (a split wholly before the window is empty), against the reference."""
    seq_lens = [1, 6, 35, 70, 300]
    batch = _decode_batch(seq_lens, 2, 64, 16, torch.float32)
    q = random_q(len(seq_lens), 6, 64, torch.float32) * 3
    args = (q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens, 16, 0.125)
    out = triton_kernels.decode_attention(*args, num_kv_splits=4, window=window, softcap=softcap)
    want = reference.decode_attention(*args, window=window, softcap=softcap)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "softcap"), [(1, None), (20, None), (None, 3.0), (70, 2.0)])
def test_extend_windows_and_soft_caps(triton_kernels: SimpleNamespace, window: int | None,
                                      softcap: float | None) -> None:
    """Windows shorter than the 64-row query tile (rows whose window starts past the first
    key tile) and longer, soft-caps, over cached prefixes, against the reference."""
    prefix_lens, extend_lens = [0, 5, 100, 33], [7, 1, 90, 70]
    batch = make_paged_batch(prefix_lens, extend_lens, 2, 64, 16, torch.float32)
    q = random_q(sum(extend_lens), 6, 64, torch.float32) * 3
    args = (q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.prefix_lens, batch.extend_lens,
            batch.qo_indptr, 16, 0.125)
    out = triton_kernels.extend_attention(*args, window=window, softcap=softcap)
    want = reference.extend_attention(*args, window=window, softcap=softcap)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
