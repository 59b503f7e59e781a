"""apply_token_bitmask against a per-token oracle."""

from __future__ import annotations

import pytest
import torch

from runtime.constrained import (
    allocate_token_bitmask,
    allowed_token_ids,
    apply_token_bitmask,
    bitmask_width,
    unpack_bitmask,
)


def _bitmask_allowing(allowed: list[set[int]], vocab_size: int) -> torch.Tensor:
    bitmask = torch.zeros(len(allowed), bitmask_width(vocab_size), dtype=torch.int32)
    for row, ids in enumerate(allowed):
        for token in ids:
            word, bit = divmod(token, 32)
            value = int(bitmask[row, word]) & 0xFFFFFFFF | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
    return bitmask


def test_width_and_all_allowed_allocation() -> None:
    assert bitmask_width(49152) == 1536 and bitmask_width(49153) == 1537
    bitmask = allocate_token_bitmask(2, 100)
    assert bitmask.shape == (2, 4) and bitmask.dtype == torch.int32
    assert allowed_token_ids(bitmask[1], 100) == list(range(100))


def test_unpack_reads_every_bit_including_the_sign_bit() -> None:
    allowed = [{0, 31, 32, 63, 64, 99}, set()]
    unpacked = unpack_bitmask(_bitmask_allowing(allowed, 100), 100)
    assert unpacked[0].nonzero().flatten().tolist() == [0, 31, 32, 63, 64, 99]
    assert not unpacked[1].any()


def test_apply_masks_every_row_to_minus_inf() -> None:
    allowed = [{1, 5, 31}, {0, 40, 70}, set(range(75))]
    logits = torch.randn(3, 75)
    expected = logits.clone()
    for row, ids in enumerate(allowed):
        for token in range(75):
            if token not in ids:
                expected[row, token] = float("-inf")
    apply_token_bitmask(logits, _bitmask_allowing(allowed, 75))
    assert torch.equal(logits, expected)


def test_apply_to_selected_rows_leaves_the_others_alone() -> None:
    allowed = [{1}, {2}, {3}]
    logits = torch.randn(3, 40)
    before = logits.clone()
    apply_token_bitmask(logits, _bitmask_allowing(allowed, 40), rows=[0, 2])
    assert torch.equal(logits[1], before[1])
    assert logits[0].isfinite().nonzero().flatten().tolist() == [1]
    assert logits[2].isfinite().nonzero().flatten().tolist() == [3]


def test_logits_wider_than_the_mask_are_disallowed_past_it() -> None:
    logits = torch.zeros(1, 70)  # mask covers 64 tokens: 2 words
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)
    apply_token_bitmask(logits, bitmask)
    assert logits[0, :64].isfinite().all() and logits[0, 64:].isneginf().all()


@pytest.mark.parametrize(
    ("logits_shape", "mask_shape", "dtype", "message"),
    [((2, 64), (3, 2), torch.int32, "share B"), ((2, 64), (2, 2), torch.int64, "int32")],
)
def test_bad_shapes_and_dtypes(
    logits_shape: tuple[int, int], mask_shape: tuple[int, int], dtype: torch.dtype, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        apply_token_bitmask(torch.zeros(logits_shape), torch.zeros(mask_shape, dtype=dtype))
