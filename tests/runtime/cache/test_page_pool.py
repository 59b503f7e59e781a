"""PagePool by example: exact page ids, the padding page, page arithmetic, the lock."""

from __future__ import annotations

import threading

import pytest

from runtime.cache.page_pool import OutOfPagesError, PagePool


def test_allocate_hands_out_lowest_ids_first() -> None:
    pool = PagePool(num_pages=8, page_size=4)
    assert pool.num_usable_pages == 7 and pool.num_free_pages == 7
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(2) == [4, 5]
    assert pool.allocate(0) == []
    assert pool.num_free_pages == 2 and pool.free_pages() == [6, 7]


def test_freed_pages_come_back_before_the_untouched_ones_lowest_first() -> None:
    # NOTE: reusing written pages before untouched ones keeps the lazily touched KV pool's
    # resident memory at its high-water mark (docs/memory.md).
    pool = PagePool(6, 4)
    assert pool.allocate(3) == [1, 2, 3]
    pool.free([2, 1])
    assert pool.num_free_pages == 4 and pool.free_pages() == [1, 2, 4, 5]
    assert pool.allocate(3) == [1, 2, 4]
    assert pool.free_pages() == [5]


def test_a_steady_churn_never_walks_the_pool() -> None:
    pool = PagePool(1000, 1)
    touched: set[int] = set()
    for _ in range(200):  # take 8, give back 8: the same low pages come back every time
        pages = pool.allocate(8)
        touched.update(pages)
        pool.free(pages[::-1])
    assert touched == set(range(1, 9))
    assert pool.num_touched_pages == 8  # the resident pages, as the engine's metrics report them


def test_touched_pages_are_the_high_water_mark_of_the_ids_handed_out() -> None:
    pool = PagePool(10, 4)
    assert pool.num_touched_pages == 0
    first = pool.allocate(5)
    pool.free(first)
    assert pool.num_touched_pages == 5  # freed pages stay written, so resident
    pool.allocate(2)
    assert pool.num_touched_pages == 5
    pool.allocate(4)  # 3, 4, 5, then the untouched 6
    assert pool.num_touched_pages == 6


def test_page_zero_is_padding_and_never_handed_out() -> None:
    pool = PagePool(5, 1)
    first = pool.allocate(4)
    assert first == [1, 2, 3, 4]
    pool.free(first[::-1])
    assert pool.allocate(4) == [1, 2, 3, 4]  # every usable page, and still no 0
    with pytest.raises(ValueError, match="invalid page 0"):
        pool.free([0])


def test_free_rejects_double_free_and_foreign_pages() -> None:
    pool = PagePool(4, 2)
    pages = pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(ValueError, match="double free or invalid page 1"):
        pool.free([1])
    for bad in (-1, 4, 99):
        with pytest.raises(ValueError, match=f"invalid page {bad}"):
            pool.free([bad])
    assert pool.free_pages() == [1, 3]  # the refused frees changed nothing


def test_allocating_past_capacity_raises_and_takes_nothing() -> None:
    pool = PagePool(4, 16)
    assert pool.allocate(2) == [1, 2]
    assert pool.num_free_pages == 1
    with pytest.raises(OutOfPagesError, match="asked for 2 pages, 1 free"):
        pool.allocate(2)
    assert issubclass(OutOfPagesError, RuntimeError)
    assert pool.free_pages() == [3] and pool.allocate(1) == [3]


def test_a_pool_needs_a_usable_page() -> None:
    with pytest.raises(ValueError, match="at least 2 pages"):
        PagePool(1, 16)


@pytest.mark.parametrize(
    ("page_size", "num_tokens", "num_pages"),
    [(4, 0, 0), (4, 1, 1), (4, 4, 1), (4, 5, 2), (4, 8, 2), (4, 9, 3), (1, 7, 7), (16, 33, 3)],
)
def test_pages_for_tokens_rounds_up_to_whole_pages(page_size: int, num_tokens: int, num_pages: int) -> None:
    assert PagePool(2, page_size).pages_for_tokens(num_tokens) == num_pages


def test_lock_is_reentrant_so_a_holder_can_move_pages() -> None:
    pool = PagePool(4, 1)
    with pool.lock:  # what the prefix cache does around an insert-then-lock
        assert pool.lock.acquire(blocking=False)  # a plain Lock would refuse (and deadlock)
        pool.lock.release()
        assert pool.allocate(2) == [1, 2]
        pool.free([1])
    assert pool.free_pages() == [1, 3]


def test_moves_wait_for_a_reader_holding_the_lock() -> None:
    pool = PagePool(4, 1)
    taken: list[list[int]] = []
    with pool.lock:
        mover = threading.Thread(target=lambda: taken.append(pool.allocate(2)))
        mover.start()
        mover.join(0.05)
        assert mover.is_alive() and pool.num_free_pages == 3  # the reader sees no half move
    mover.join(5)
    assert taken == [[1, 2]] and pool.num_free_pages == 1
