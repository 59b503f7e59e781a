"""The KV tier's bookkeeping: prefix keys, exact slots, LRU order, locks, pending writes."""

from __future__ import annotations

import pytest

from runtime.cache.tier_index import TierIndex

PS = 4


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def stored(index: TierIndex, keys: list[bytes]) -> list[int | None]:
    """Reserve ``keys`` and finish their writes at once (checksum = slot)."""
    slots = index.reserve(keys)
    for slot in slots:
        if slot is not None:
            index.written(slot, slot)
    return slots


def test_a_key_names_the_whole_prefix_and_its_namespace() -> None:
    index = TierIndex(8, PS)
    a = index.keys(ids(12), None, 3)
    assert len(a) == 3 and len(set(a)) == 3
    assert index.keys(ids(8), None, 2) == a[:2]  # a prefix has the same keys
    other_first_page = index.keys([7, *ids(11, 101)], None, 3)
    assert other_first_page[1:] != a[1:]  # the same later pages after another first page
    assert not set(index.keys(ids(12), '["t", null]', 3)) & set(a)  # another namespace


def test_lookup_finds_the_longest_held_run_from_the_first_key() -> None:
    index = TierIndex(8, PS)
    keys = index.keys(ids(16), None, 4)
    assert stored(index, keys[:3]) == [0, 1, 2]
    assert index.lookup(keys) == [0, 1, 2]
    assert index.lookup(keys[1:]) == [1, 2]
    assert index.lookup(keys[3:]) == []
    index.check_integrity()


def test_lru_keeps_a_prefix_newer_than_what_extends_it() -> None:
    index = TierIndex(4, PS)
    a = index.keys(ids(12), None, 3)
    stored(index, a[1:])  # a leaf's pages go first (their ancestors are still in the pool)
    stored(index, a[:1])  # then the ancestor
    assert index.slots_by_age() == [1, 0, 2]  # deepest oldest, the first page newest
    b = index.keys(ids(8, 500), None, 2)
    assert stored(index, b) == [3, 1]  # slot 1 (a's deepest page) was the oldest
    assert index.lookup(a) == [2, 0]  # a's two first pages are still reachable
    index.check_integrity()


def test_locked_and_pending_slots_are_never_taken() -> None:
    index = TierIndex(2, PS)
    a = index.keys(ids(8), None, 2)
    stored(index, a)
    index.lock_slots((0, 1))
    b = index.keys(ids(4, 900), None, 1)
    assert index.reserve(b) == [None]  # every slot locked: the page is not kept
    with pytest.raises(AssertionError, match="locked while idle"):
        index.check_integrity()
    index.unlock_slots((0, 1))
    [slot] = index.reserve(b)
    assert slot == 1  # a's deepest page, the oldest
    assert index.is_pending(slot)
    assert index.reserve(index.keys(ids(4, 950), None, 1)) == [0]
    assert index.reserve(index.keys(ids(4, 990), None, 1)) == [None]  # both pending
    index.written(1, 11)
    index.written(0, 10)
    assert index.checksum(1) == 11 and index.num_pending == 0
    index.check_integrity()


def test_a_failed_write_or_a_corrupt_page_frees_its_slot() -> None:
    index = TierIndex(3, PS)
    keys = index.keys(ids(12), None, 3)
    slots = index.reserve(keys)
    index.written(0, 5)
    index.written(1, None)  # the disk failed
    index.written(2, 7)
    assert index.lookup(keys) == [0]  # the run ends where the page is missing
    index.drop(0)
    assert index.lookup(keys) == []
    assert index.num_pages == 1 and slots == [0, 1, 2]
    index.check_integrity()


def test_clear_keeps_locked_and_pending_pages() -> None:
    index = TierIndex(4, PS)
    keys = index.keys(ids(12), None, 3)
    stored(index, keys[:2])
    index.lock_slots((0,))
    index.reserve(keys[2:])  # pending
    assert index.clear() == 1
    assert sorted(index.slots_by_age()) == [0, 2]
    index.unlock_slots((0,))
    index.written(2, 1)
    index.check_integrity()


def test_a_tier_without_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        TierIndex(0, PS)
