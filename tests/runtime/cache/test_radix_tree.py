"""RadixTree by example: exact page ids, splits, page alignment, LRU eviction, locking."""

from __future__ import annotations

import pytest

from runtime.cache.no_prefix_cache import NoPrefixCache
from runtime.cache.page_pool import PagePool
from runtime.cache.prefix_cache import EMPTY_MATCH, PrefixMatch
from runtime.cache.radix_tree import RadixTree


def make(num_pages: int = 33, page_size: int = 1) -> tuple[PagePool, RadixTree]:
    pool = PagePool(num_pages, page_size)
    return pool, RadixTree(pool)


def insert(pool: PagePool, tree: RadixTree, tokens: list[int]) -> list[int]:
    """What a finished request does: match, lock, own pages for the rest, cache_finished."""
    match = tree.match_prefix(tokens)
    tree.lock(match)
    own = pool.allocate(pool.pages_for_tokens(len(tokens)) - len(match.pages))
    pages = match.pages + own
    tree.cache_finished(tokens, pages, match)
    tree.check_integrity()
    return pages


def test_insert_and_match_exact_pages() -> None:
    pool, tree = make()
    assert insert(pool, tree, [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert tree.match_prefix([1, 2, 3, 4, 5]) == PrefixMatch(4, [1, 2, 3, 4], tree.match_prefix([1, 2, 3, 4]).node)
    # A second sequence sharing [1, 2] reuses pages 1, 2 and gets fresh pages 5, 6.
    assert insert(pool, tree, [1, 2, 7, 8]) == [1, 2, 5, 6]
    assert sorted(tree.cached_pages()) == [1, 2, 3, 4, 5, 6]
    assert tree.match_prefix([1, 2, 7]).pages == [1, 2, 5]
    assert tree.match_prefix([9]) is EMPTY_MATCH
    assert pool.num_free_pages == 32 - 6
    assert (tree.num_evictable_pages, tree.num_locked_pages) == (6, 0)


def test_partial_match_splits_edge_at_page_boundary() -> None:
    pool, tree = make(page_size=2)
    assert insert(pool, tree, [1, 2, 3, 4, 5, 6]) == [1, 2, 3]  # one edge, three pages
    # [1 2 | 3 9 ...]: the second page differs, so only the first page matches and the edge
    # splits after it; the lower half keeps pages 2, 3.
    m = tree.match_prefix([1, 2, 3, 9, 5, 6])
    assert (m.num_tokens, m.pages) == (2, [1])
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).pages == [1, 2, 3]
    tree.check_integrity()
    # The split node carries the count of its lower half: locking the long match locks both.
    long = tree.match_prefix([1, 2, 3, 4, 5, 6])
    tree.lock(long)
    assert (tree.num_locked_pages, tree.num_evictable_pages) == (3, 0)
    tree.unlock(long)
    assert (tree.num_locked_pages, tree.num_evictable_pages) == (0, 3)


def test_page_aligned_matching_page_size_4() -> None:
    pool, tree = make(page_size=4)
    # 10 tokens: two full pages are cached, the partial third page is freed.
    assert insert(pool, tree, list(range(10, 20))) == [1, 2, 3]
    assert sorted(tree.cached_pages()) == [1, 2] and 3 in pool.free_pages()
    assert tree.match_prefix(list(range(10, 17))).pages == [1]  # 7 tokens -> 1 full page
    assert tree.match_prefix(list(range(10, 18))).pages == [1, 2]  # 8 tokens -> 2 pages
    assert tree.match_prefix([10, 11, 12]) is EMPTY_MATCH  # under one page: nothing
    # Differs inside the second page: only the first page is shared.
    m = tree.match_prefix([10, 11, 12, 13, 14, 15, 99, 17])
    assert (m.num_tokens, m.pages) == (4, [1])
    # Inserting that sequence shares page 1 and adds one new page under it (page 3 again,
    # the lowest free one).
    assert insert(pool, tree, [10, 11, 12, 13, 14, 15, 99, 17]) == [1, 3]
    assert sorted(tree.cached_pages()) == [1, 2, 3]


def test_cache_finished_frees_duplicates_of_concurrent_inserts() -> None:
    pool, tree = make()
    a, b = tree.match_prefix([1, 2, 3]), tree.match_prefix([1, 2, 3])
    tree.lock(a)
    tree.lock(b)
    pages_a, pages_b = pool.allocate(3), pool.allocate(3)  # [1 2 3], [4 5 6]
    tree.cache_finished([1, 2, 3], pages_a, a)
    tree.cache_finished([1, 2, 3], pages_b, b)  # same tokens computed twice: b's pages freed
    assert sorted(tree.cached_pages()) == [1, 2, 3]
    assert {4, 5, 6} <= set(pool.free_pages())
    tree.check_integrity()


def test_cache_unfinished_hands_back_cache_pages_and_moves_the_lock() -> None:
    pool, tree = make(page_size=2)
    insert(pool, tree, [1, 2, 3, 4])  # pages [1, 2]
    # A running request computed [1 2 3 4 5 6 7] on its own pages [3 4 5 6] (duplicate
    # of the cached [1 2 3 4], then one new full page, then a partial page).
    m = EMPTY_MATCH
    pages = pool.allocate(4)
    new_match, table = tree.cache_unfinished([1, 2, 3, 4, 5, 6, 7], pages, m)
    assert (new_match.num_tokens, new_match.pages) == (6, [1, 2, 5])
    assert table == [1, 2, 5, 6]  # cache pages, then its own partial page
    assert {3, 4} <= set(pool.free_pages())  # the duplicates
    assert (tree.num_locked_pages, tree.num_evictable_pages) == (3, 0)
    tree.cache_finished([1, 2, 3, 4, 5, 6, 7], table, new_match)
    assert (tree.num_locked_pages, tree.num_evictable_pages) == (0, 3)
    assert 6 in pool.free_pages()
    tree.check_integrity()


def test_lru_eviction_order_leaves_first() -> None:
    pool, tree = make()
    insert(pool, tree, [1, 2, 3])  # pages 1 2 3          t1
    insert(pool, tree, [1, 2, 7])  # shares [1 2]; page 4 t2 (splits: [1 2] / [3] / [7])
    insert(pool, tree, [5, 6])  # pages 5 6               t3
    tree.match_prefix([1, 2, 3])  # touch: now [7] is the least recently used leaf
    assert tree.evict(1) == 1
    assert sorted(tree.cached_pages()) == [1, 2, 3, 5, 6] and 4 in pool.free_pages()
    assert tree.evict(1) == 2  # leaf [5 6] is one node: both pages go together
    assert sorted(tree.cached_pages()) == [1, 2, 3]
    # [3] goes before its parent [1 2] (leaves first), then the parent.
    assert tree.evict(1) == 1 and sorted(tree.cached_pages()) == [1, 2]
    assert tree.evict(10) == 2
    assert tree.cached_pages() == [] and tree.num_evictable_pages == 0
    tree.check_integrity()


def test_locked_nodes_are_never_evicted() -> None:
    pool, tree = make()
    insert(pool, tree, [1, 2, 3])  # pages 1 2 3
    insert(pool, tree, [1, 2, 4])  # page 4
    m = tree.match_prefix([1, 2, 3])
    tree.lock(m)
    assert (tree.num_locked_pages, tree.num_evictable_pages) == (3, 1)
    assert tree.num_unlocked_pages(tree.match_prefix([1, 2, 4])) == 1
    assert tree.evict(100) == 1  # only [4]; [1 2] is an ancestor of the locked [3]
    assert sorted(tree.cached_pages()) == [1, 2, 3]
    tree.lock(m)  # two requests on the same prefix
    tree.unlock(m)
    assert tree.evict(100) == 0
    tree.unlock(m)
    assert tree.evict(100) == 3
    tree.check_integrity()


def test_lock_survives_a_later_split() -> None:
    pool, tree = make()
    insert(pool, tree, [1, 2, 3, 4])
    m = tree.match_prefix([1, 2, 3, 4])
    tree.lock(m)
    tree.match_prefix([1, 2, 9])  # splits the locked edge after [1 2]
    tree.check_integrity()
    assert (tree.num_locked_pages, tree.num_evictable_pages) == (4, 0)
    tree.unlock(m)
    assert (tree.num_locked_pages, tree.num_evictable_pages) == (0, 4)
    tree.check_integrity()


def test_no_prefix_cache_shares_nothing_and_frees_everything() -> None:
    pool = PagePool(9, 2)
    cache = NoPrefixCache(pool)
    pages = pool.allocate(3)
    assert cache.match_prefix([1, 2, 3, 4]) is EMPTY_MATCH
    assert cache.cache_unfinished([1, 2, 3, 4, 5], pages, EMPTY_MATCH) == (EMPTY_MATCH, pages)
    cache.cache_finished([1, 2, 3, 4, 5], pages, EMPTY_MATCH)
    assert pool.num_free_pages == 8 and cache.cached_pages() == []
    assert (cache.num_evictable_pages, cache.num_locked_pages, cache.evict(5)) == (0, 0, 0)


def test_a_reader_holding_the_pool_lock_sees_whole_page_moves() -> None:
    """Gauges are read from other threads (metrics) while the engine thread moves pages.

    A reader holding ``pool.lock`` must see ``usable - free - evictable`` (pages in use)
    equal to what the request really holds: never the dip while a prefill's pages are
    inserted but not yet locked, nor while an evicted leaf is freed but still counted.
    """
    import sys
    import threading

    pool, tree = make(num_pages=512)
    holds = [0]  # pages the request holds, changed together with the pages it counts
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            with pool.lock:
                used = pool.num_usable_pages - pool.num_free_pages - tree.num_evictable_pages
                if used != holds[0]:
                    seen.append((used, holds[0]))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(300):
            tokens = [i, *range(1000, 1127)]  # a new first token: a new leaf each time
            with pool.lock:
                pages = pool.allocate(len(tokens))
                holds[0] = len(pages)
            match, pages = tree.cache_unfinished(tokens, pages, EMPTY_MATCH)  # prefill done
            with pool.lock:
                tree.cache_finished(tokens, pages, match)  # request done
                holds[0] = 0
            tree.evict(len(tokens))
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert seen == []
    tree.check_integrity()


def test_eviction_follows_touches_through_heap_rebuilds() -> None:
    pool, tree = make()
    a = insert(pool, tree, [1, 2])
    b = insert(pool, tree, [3, 4])
    c = insert(pool, tree, [5, 6])
    assert set(b).isdisjoint(a + c)
    for _ in range(200):  # each touch pushes a fresh heap entry; stale ones force rebuilds
        tree.match_prefix([1, 2])
        tree.match_prefix([5, 6])
    tree.check_integrity()  # every evictable leaf has a current heap entry
    assert len(tree._heap) <= 2 * 3 + 64 + 1  # rebuilt, not grown with every touch
    assert tree.evict(1) == 2 and sorted(tree.cached_pages()) == sorted(a + c)  # b: least recent
    assert tree.evict(1) == 2 and sorted(tree.cached_pages()) == sorted(c)  # a: touched before c
    tree.check_integrity()


def test_a_locked_leaf_is_skipped_and_evictable_again_once_unlocked() -> None:
    pool, tree = make()
    old = insert(pool, tree, [1, 2])
    insert(pool, tree, [3, 4])
    match = tree.match_prefix([1, 2])  # now the most recent, and locked
    tree.lock(match)
    assert tree.evict(4) == 2 and sorted(tree.cached_pages()) == sorted(old)
    tree.unlock(match)
    tree.check_integrity()
    assert tree.evict(4) == 2 and tree.cached_pages() == []


def test_max_evictable_pages_evicts_lru_leaves_once_unlocked() -> None:
    pool = PagePool(33, 1)
    tree = RadixTree(pool, max_evictable_pages=4)
    insert(pool, tree, [1, 2, 3])  # pages 1 2 3                 t1
    insert(pool, tree, [4, 5])  # pages 4 5: 5 kept > 4, so [1 2 3] (LRU) goes
    assert sorted(tree.cached_pages()) == [4, 5] and tree.num_evictable_pages == 2
    held = tree.match_prefix([4, 5])
    tree.lock(held)  # a running request's prefix is never trimmed
    insert(pool, tree, [6, 7, 8, 9])  # pages 1 2 3 6 (lowest free first): 4 evictable, at the bound
    assert sorted(tree.cached_pages()) == [1, 2, 3, 4, 5, 6]
    insert(pool, tree, [10])  # 5 evictable: the LRU unlocked leaf [6 7 8 9] goes, [4 5] stays
    assert sorted(tree.cached_pages()) == [4, 5, 7]
    tree.unlock(held)
    assert tree.num_evictable_pages == 3 and tree.num_locked_pages == 0
    tree.check_integrity()


def test_max_evictable_pages_zero_keeps_nothing_after_finish() -> None:
    pool = PagePool(9, 1)
    tree = RadixTree(pool, max_evictable_pages=0)
    insert(pool, tree, [1, 2, 3])
    assert tree.cached_pages() == [] and pool.num_free_pages == 8
    with pytest.raises(ValueError, match="max_evictable_pages must be >= 0"):
        RadixTree(pool, max_evictable_pages=-1)
