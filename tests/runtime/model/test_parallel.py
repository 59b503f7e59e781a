"""Tensor-parallel shard plans: which heads, rows and vocabulary each rank holds."""

from __future__ import annotations

import pytest

from runtime.errors import InvalidRequestError
from runtime.model.llama import ModelArgs
from runtime.model.parallel import ShardPlan, partition


def args(heads: int, kv_heads: int, inter: int = 128, vocab: int = 10) -> ModelArgs:
    return ModelArgs(vocab_size=vocab, hidden_size=64, intermediate_size=inter, num_layers=2, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=64,
                     rope={"rope_theta": 10000.0}, qkv_bias=False, tie_word_embeddings=False)


def test_partition_is_contiguous_and_as_even_as_possible() -> None:
    assert partition(10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert partition(4, 2) == [range(0, 2), range(2, 4)]


def test_kv_heads_split_when_there_are_enough() -> None:
    plans = [ShardPlan.build(args(4, 2), r, 2) for r in range(2)]
    assert [(p.q_heads, p.kv_heads) for p in plans] == [(range(0, 2), range(0, 1)), (range(2, 4), range(1, 2))]
    assert [p.vocab for p in plans] == [range(0, 5), range(5, 10)] and plans[1].inter == range(64, 128)


def test_uneven_kv_heads_take_their_q_heads_along() -> None:  # the default model: 9 heads, 3 KV heads
    plans = [ShardPlan.build(args(9, 3), r, 2) for r in range(2)]
    assert [(p.q_heads, p.kv_heads) for p in plans] == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    assert plans[1].local_args(args(9, 3)).num_heads == 3 and plans[1].local_args(args(9, 3)).vocab_size == 10


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    plans = [ShardPlan.build(args(4, 1), r, 2) for r in range(2)]
    assert [(p.q_heads, p.kv_heads) for p in plans] == [(range(0, 2), range(0, 1)), (range(2, 4), range(0, 1))]


def test_impossible_splits_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="exceeds"):
        ShardPlan.build(args(4, 2), 0, 8)
    with pytest.raises(InvalidRequestError, match="unevenly"):
        ShardPlan.build(args(8, 2), 1, 3)  # q heads 3-5: one reads kv head 0, two kv head 1
