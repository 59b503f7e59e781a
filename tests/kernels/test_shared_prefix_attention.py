"""Shared-prefix ("cascade") attention in the torch reference: same result, fewer reads.

Requests of a batch are made to point at the same leading pages (as radix-shared prefixes
do); attention with ``shared`` groups must equal attention without them and the naive
oracle, for decode and extend, with whole-batch and partial groups.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_batch import PagedBatch, make_paged_batch, naive_attention, random_q

from kernels import SharedPrefix, reference

HEAD_DIM = 32
SCALE = HEAD_DIM**-0.5


def share(batch: PagedBatch, groups: list[tuple[list[int], int]]) -> tuple[PagedBatch, list[SharedPrefix]]:
    """Point each group's members at their first member's leading ``n`` pages."""
    table = batch.page_table.clone()
    shared = []
    for rows, n in groups:
        table[rows[1:], :n] = table[rows[0], :n]
        shared.append(SharedPrefix(table[rows[0], :n].long(), torch.tensor(rows)))
    return dataclasses.replace(batch, page_table=table), shared


@pytest.mark.parametrize(("page_size", "pages"), [(1, 20), (16, 2)])
@pytest.mark.parametrize("whole_batch", [True, False])
def test_decode_with_shared_prefix_equals_plain(page_size: int, pages: int, whole_batch: bool) -> None:
    seq_lens = [40, 50, 70, 36, 45]
    batch = make_paged_batch([n - 1 for n in seq_lens], [1] * 5, 2, HEAD_DIM, page_size, torch.float32)
    groups = [([0, 1, 2, 3, 4], pages)] if whole_batch else [([0, 2, 3], pages), ([1, 4], 1)]
    batch, shared = share(batch, groups)
    q = random_q(5, 6, HEAD_DIM, torch.float32)
    args = (q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.seq_lens, page_size, SCALE)
    plain = reference.decode_attention(*args)
    cascaded = reference.decode_attention(*args, shared)
    torch.testing.assert_close(cascaded, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cascaded, naive_attention(q, batch, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prefix_lens", [[32, 40, 0, 35], [32, 32, 0, 32]], ids=["beyond", "exactly"])
def test_extend_with_shared_prefix_equals_plain(page_size: int, prefix_lens: list[int]) -> None:
    # Rows 0, 1 and 3 extend past a common 32-token cached prefix; row 2 starts from scratch.
    # "exactly": the shared prefix is every row's whole prefix, so once it is read apart the
    # rest is plain causal attention (the fused kernel's causal mode), merged with it.
    extend_lens = [5, 1, 9, 17]
    batch = make_paged_batch(prefix_lens, extend_lens, 2, HEAD_DIM, page_size, torch.float32)
    batch, shared = share(batch, [([0, 1, 3], 32 // page_size)])
    q = random_q(sum(extend_lens), 4, HEAD_DIM, torch.float32)
    args = (q, batch.k_buffer, batch.v_buffer, batch.page_table, batch.prefix_lens,
            batch.extend_lens, batch.qo_indptr, page_size, SCALE)
    plain = reference.extend_attention(*args)
    cascaded = reference.extend_attention(*args, shared)
    torch.testing.assert_close(cascaded, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cascaded, naive_attention(q, batch, SCALE), atol=1e-5, rtol=1e-5)
