"""Cache namespaces in the radix tree: a prefix cached in one namespace (a tenant, a
cache_salt) is never matched in another; eviction stays one LRU over all of them."""

from __future__ import annotations

import pytest

from runtime.cache.namespace import MAX_CACHE_SALT_LEN, cache_namespace, check_cache_salt
from runtime.cache.page_pool import PagePool
from runtime.cache.prefix_cache import EMPTY_MATCH
from runtime.cache.radix_tree import RadixTree


def insert(pool: PagePool, tree: RadixTree, tokens: list[int], namespace: str | None) -> list[int]:
    match = tree.match_prefix(tokens, namespace)
    tree.lock(match)
    pages = match.pages + pool.allocate(pool.pages_for_tokens(len(tokens)) - len(match.pages))
    tree.cache_finished(tokens, pages, match, namespace)
    tree.check_integrity()
    return pages


def test_a_prefix_is_matched_only_in_its_own_namespace() -> None:
    pool = PagePool(33, 1)
    tree = RadixTree(pool)
    assert insert(pool, tree, [1, 2, 3, 4], "a") == [1, 2, 3, 4]
    assert tree.match_prefix([1, 2, 3, 4, 5], "a").pages == [1, 2, 3, 4]
    assert tree.match_prefix([1, 2, 3, 4, 5], "b") is EMPTY_MATCH
    assert tree.match_prefix([1, 2, 3, 4, 5]) is EMPTY_MATCH  # the shared default is a namespace too
    # The same tokens in "b" get pages of their own: nothing is shared across namespaces.
    assert insert(pool, tree, [1, 2, 3, 4], "b") == [5, 6, 7, 8]
    assert insert(pool, tree, [1, 2, 9], None) == [9, 10, 11]
    assert tree.match_prefix([1, 2, 3], "b").pages == [5, 6, 7]
    assert tree.match_prefix([1, 2, 3]).pages == [9, 10]
    assert (tree.num_evictable_pages, pool.num_free_pages) == (11, 32 - 11)


def test_running_requests_insert_into_their_namespace() -> None:
    pool = PagePool(17, 2)
    tree = RadixTree(pool)
    own = pool.allocate(3)
    match, table = tree.cache_unfinished([1, 2, 3, 4, 5], own, EMPTY_MATCH, "t")
    assert (match.num_tokens, table) == (4, own)
    assert tree.match_prefix([1, 2, 3, 4, 6], "t").num_tokens == 4
    assert tree.match_prefix([1, 2, 3, 4, 6], "u") is EMPTY_MATCH
    assert tree.num_locked_pages == 2
    tree.cache_finished([1, 2, 3, 4, 5], table, match, "t")
    tree.check_integrity()
    assert (tree.num_locked_pages, tree.num_evictable_pages) == (0, 2)


def test_eviction_is_one_lru_across_namespaces_and_drops_empty_roots() -> None:
    pool = PagePool(9, 1)
    tree = RadixTree(pool)
    insert(pool, tree, [1, 2], "old")
    insert(pool, tree, [1, 2], None)
    insert(pool, tree, [1, 2], "new")
    assert tree.evict(2) == 2  # the least recently used leaf, whatever its namespace
    assert tree.match_prefix([1, 2], "old") is EMPTY_MATCH
    assert "old" not in tree._roots  # no root is kept for a namespace with nothing cached
    tree.check_integrity()
    assert tree.match_prefix([1, 2]).num_tokens == 2 and tree.match_prefix([1, 2], "new").num_tokens == 2
    assert tree.evict(10) == 4
    assert set(tree._roots) == {None}  # the default root stays
    tree.check_integrity()
    assert pool.num_free_pages == 8


def test_namespace_keys() -> None:
    assert cache_namespace(None, None) is None  # anonymous, unsalted: the shared default
    keys = {cache_namespace("a", None), cache_namespace(None, "a"), cache_namespace("a", "a"),
            cache_namespace("a|b", "c"), cache_namespace("a", "b|c"), None}
    assert len(keys) == 6  # no two (tenant, salt) pairs collide
    # Sharing across tenants drops the tenant; the salt still separates.
    assert cache_namespace("a", None, share_across_tenants=True) is None
    assert cache_namespace("a", "s", True) == cache_namespace("b", "s", True) != cache_namespace("b", "t", True)


@pytest.mark.parametrize(("salt", "message"), [
    ("", "non-empty"), (7, "must be a string"), (["x"], "must be a string"),
    ("x" * (MAX_CACHE_SALT_LEN + 1), "at most"),
])
def test_bad_cache_salts_are_refused(salt: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_cache_salt(salt)


def test_good_cache_salt() -> None:
    assert check_cache_salt(None) is None
    assert check_cache_salt("x" * MAX_CACHE_SALT_LEN) == "x" * MAX_CACHE_SALT_LEN
