"""The torch reference ops (the spec) against an independent naive oracle.

The oracle walks each page table in Python and runs ``F.scaled_dot_product_attention`` per
request with ``repeat_interleave`` for GQA; no Triton involved.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_batch import make_paged_batch, naive_attention, random_q

from kernels import reference
from kernels.reference.attention import plan_extend

HEAD_DIM = 32
SCALE = HEAD_DIM**-0.5
GQA = [(2, 1), (2, 3), (1, 8)]  # (num_kv_heads, query heads per KV head)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("num_kv_heads", "group"), GQA)
def test_reference_decode_matches_naive_sdpa(page_size: int, num_kv_heads: int, group: int) -> None:
    seq_lens = [1, 6, 16, 35, 70]
    batch = make_paged_batch(
        [n - 1 for n in seq_lens],
        [1] * len(seq_lens),
        num_kv_heads,
        HEAD_DIM,
        page_size,
        torch.float32,
    )
    q = random_q(len(seq_lens), num_kv_heads * group, HEAD_DIM, torch.float32)
    out = reference.decode_attention(
        q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens, page_size, SCALE
    )
    torch.testing.assert_close(out, naive_attention(q, batch, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("num_kv_heads", "group"), GQA)
@pytest.mark.parametrize("prefix_lens", [[0, 5, 16, 33], [0, 0, 0, 0]], ids=["prefixed", "fresh"])
def test_reference_extend_matches_naive_sdpa(
        page_size: int, num_kv_heads: int, group: int, prefix_lens: list[int]) -> None:
    # "fresh": no request has a prefix, so the plan is plain causal (the fused kernel's
    # causal mode, no mask) even though the shorter requests are padded.
    extend_lens = [7, 1, 20, 70]
    batch = make_paged_batch(
        prefix_lens, extend_lens, num_kv_heads, HEAD_DIM, page_size, torch.float32
    )
    q = random_q(sum(extend_lens), num_kv_heads * group, HEAD_DIM, torch.float32)
    plan = plan_extend(batch.page_table, batch.prefix_lens, batch.extend_lens, batch.qo_indptr, page_size)
    assert plan.causal == (not any(prefix_lens))
    out = reference.extend_attention(
        q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.prefix_lens,
        batch.extend_lens, batch.qo_indptr, page_size, SCALE,
    )  # fmt: skip
    torch.testing.assert_close(out, naive_attention(q, batch, SCALE), atol=1e-5, rtol=1e-5)
    again = reference.extend_attention(
        q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.prefix_lens,
        batch.extend_lens, batch.qo_indptr, page_size, SCALE, plan=plan,
    )  # fmt: skip
    torch.testing.assert_close(again, out, atol=0, rtol=0)


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (None, 2.0), (5, 2.0)])
@pytest.mark.parametrize("prefix_lens", [[0, 5, 16, 33], [0, 0, 0, 0]], ids=["prefixed", "fresh"])
def test_windows_and_soft_caps_match_naive(window: int | None, softcap: float | None, prefix_lens: list[int]) -> None:
    """Sliding windows (Mistral, Gemma) and soft-capped scores (Gemma 2), extend and
    decode, on the dispatcher (the reference on every backend for such layers)."""
    import kernels

    extend_lens, page_size = [7, 1, 20, 9], 4
    batch = make_paged_batch(prefix_lens, extend_lens, 2, HEAD_DIM, page_size, torch.float32)
    q = random_q(sum(extend_lens), 4, HEAD_DIM, torch.float32)
    out = kernels.extend_attention(q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.prefix_lens,
                                   batch.extend_lens, batch.qo_indptr, page_size, SCALE, window=window,
                                   softcap=softcap)
    want = naive_attention(q, batch, SCALE, window, softcap)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    decode = make_paged_batch([p + e - 1 for p, e in zip(prefix_lens, extend_lens, strict=True)],
                              [1] * 4, 2, HEAD_DIM, page_size, torch.float32)
    q1 = random_q(4, 4, HEAD_DIM, torch.float32)
    out1 = kernels.decode_attention(q1, decode.k_buffer, decode.v_buffer, decode.page_table, decode.seq_lens,
                                    page_size, SCALE, window=window, softcap=softcap)
    torch.testing.assert_close(out1, naive_attention(q1, decode, SCALE, window, softcap), atol=1e-5, rtol=1e-5)


def test_a_window_plan_refuses_shared_prefixes() -> None:
    from kernels.reference.attention import SharedPrefix, plan_decode

    shared = [SharedPrefix(torch.tensor([1]), torch.tensor([0, 1]))]
    with pytest.raises(ValueError, match="a windowed plan reads no shared prefixes"):
        plan_decode(torch.ones(2, 2, dtype=torch.int32), torch.tensor([3, 3], dtype=torch.int32), 2, shared, 4)


def test_reference_store_kv_writes_exactly_the_given_slots() -> None:
    k_buffer, v_buffer = (
        torch.zeros(10, 2, 4, dtype=torch.float16),
        torch.zeros(10, 2, 4, dtype=torch.float16),
    )
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    slots = torch.tensor([7, 0, 4])
    reference.store_kv(k_buffer, v_buffer, k, v, slots)
    assert torch.equal(k_buffer[slots], k.half()) and torch.equal(v_buffer[slots], v.half())
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[slots] = False
    assert not k_buffer[untouched].any() and not v_buffer[untouched].any()


def test_reference_rms_norm_matches_torch() -> None:
    x, weight = torch.randn(4, 3, 96), torch.randn(96)
    expected = F.rms_norm(x, (96,), weight, eps=1e-5)
    torch.testing.assert_close(reference.rms_norm(x, weight, 1e-5), expected, atol=1e-6, rtol=1e-5)
