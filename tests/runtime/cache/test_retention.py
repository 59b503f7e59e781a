"""Retention pins in the radix tree: exact eviction order, budgets, deadlines, release."""

from __future__ import annotations

import logging

import pytest

from runtime.cache.page_pool import PagePool
from runtime.cache.radix_tree import RadixTree
from runtime.cache.retention import Retention
from tests.runtime.cache.test_radix_tree import insert


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(num_pages: int = 33, budget: int | None = None) -> tuple[PagePool, RadixTree, Clock]:
    pool, clock = PagePool(num_pages, 1), Clock()
    return pool, RadixTree(pool, retention_max_pages=budget, clock=clock), clock


def cached(tree: RadixTree, tokens: list[int]) -> int:
    return tree.match_prefix(tokens).num_tokens


def hint(session: str, ttl_s: float = 10.0, owner: str = "t") -> Retention:
    return Retention(session, ttl_s, owner)


def test_pinned_prefix_outlives_newer_unpinned_leaves() -> None:
    pool, tree, _ = make()
    insert(pool, tree, [1, 2, 3])  # the session's state, oldest
    assert tree.retain(hint("run"), [1, 2, 3])
    insert(pool, tree, [4, 5, 6])
    insert(pool, tree, [7, 8, 9])
    assert (tree.num_retained_pages, tree.num_evictable_pages) == (3, 9)  # pinned still count
    assert tree.evict(3) == 3  # LRU would take [1 2 3]; the pin sends it to [4 5 6]
    assert (cached(tree, [1, 2, 3]), cached(tree, [4, 5, 6]), cached(tree, [7, 8, 9])) == (3, 0, 3)
    tree.check_integrity()


def test_pins_go_last_earliest_deadline_first_then_whole_session() -> None:
    pool, tree, clock = make()
    insert(pool, tree, [1, 2])
    tree.retain(hint("short", ttl_s=1.0), [1, 2])
    insert(pool, tree, [3, 4])
    tree.retain(hint("long", ttl_s=50.0), [3, 4])
    insert(pool, tree, [5, 6])
    clock.now += 5  # "short" is past its deadline, "long" is not
    assert tree.evict(2) == 2
    assert (cached(tree, [1, 2]), cached(tree, [3, 4]), cached(tree, [5, 6])) == (2, 2, 0)
    assert tree.evict(1) == 2  # a session goes whole: the expired one, both its pages
    assert (cached(tree, [1, 2]), cached(tree, [3, 4])) == (0, 2)
    assert list(tree.retention.sessions) == ["long"]
    assert tree.evict(10) == 2  # only when nothing else is left does a live pin go
    assert tree.retention.sessions == {} and tree.num_retained_pages == 0
    tree.check_integrity()


def test_ended_session_leaves_go_before_any_lru_leaf() -> None:
    pool, tree, _ = make()
    insert(pool, tree, [1, 2])  # plain LRU, oldest
    insert(pool, tree, [3, 4, 5])
    tree.retain(hint("run"), [3, 4, 5])
    assert tree.release("run") == 3
    assert tree.evict(3) == 3  # the ended run's leaf, though [1 2] is older
    assert (cached(tree, [1, 2]), cached(tree, [3, 4, 5])) == (2, 0)
    assert tree.release("run") == 0  # releasing twice is harmless
    tree.check_integrity()


def test_next_turn_replaces_the_pin_it_extends() -> None:
    pool, tree, _ = make()
    insert(pool, tree, [1, 2, 3])
    tree.retain(hint("run"), [1, 2, 3])
    insert(pool, tree, [1, 2, 3, 4, 5])  # the conversation grew
    tree.retain(hint("run"), [1, 2, 3, 4, 5])
    session = tree.retention.sessions["run"]
    assert [n.key for n in session.pins] == [(4, 5)]  # one pin: the deeper node
    assert tree.num_retained_pages == 5
    insert(pool, tree, [1, 2, 9])  # a sibling branch of the same prefix is not pinned
    assert tree.evict(1) == 1 and cached(tree, [1, 2, 9]) == 2
    tree.check_integrity()


def test_owner_budget_refuses_a_pin_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    pool, tree, _ = make(budget=4)
    insert(pool, tree, [1, 2, 3])
    insert(pool, tree, [7, 8, 9])
    assert tree.retain(hint("a"), [1, 2, 3])
    with caplog.at_level(logging.WARNING, "arbor.cache"):
        assert not tree.retain(hint("b"), [7, 8, 9])  # same owner: 6 pages > 4
        assert not tree.retain(hint("b"), [7, 8, 9])
    assert sum("over its owner's budget" in r.message for r in caplog.records) == 1
    assert tree.retention.num_refused == 2
    assert tree.retain(hint("c", owner="other"), [7, 8, 9])  # another owner's own budget
    assert tree.num_retained_pages == 6
    tree.check_integrity()


def test_owner_expired_sessions_are_dropped_before_its_budget_is_checked() -> None:
    pool, tree, clock = make(budget=4)
    insert(pool, tree, [1, 2, 3])
    insert(pool, tree, [7, 8, 9])
    tree.retain(hint("a", ttl_s=1.0), [1, 2, 3])
    clock.now += 2
    assert tree.retain(hint("b"), [7, 8, 9])
    assert list(tree.retention.sessions) == ["b"]
    tree.check_integrity()


def test_split_of_a_pinned_edge_keeps_counts() -> None:
    pool, tree, _ = make()
    insert(pool, tree, [1, 2, 3, 4])
    tree.retain(hint("run"), [1, 2, 3, 4])
    insert(pool, tree, [1, 2, 7])  # splits the pinned edge after [1 2]
    tree.check_integrity()
    assert tree.num_retained_pages == 4
    assert tree.evict(10) == 5  # everything unlocked goes in the end, pins last
    assert pool.num_free_pages == 32
    tree.check_integrity()


def test_locked_pinned_prefix_is_not_evicted_when_released() -> None:
    pool, tree, _ = make()
    insert(pool, tree, [1, 2])
    tree.retain(hint("run"), [1, 2])
    match = tree.match_prefix([1, 2])
    tree.lock(match)  # a running request of the run uses it
    assert tree.evict(5) == 0  # the session was unpinned, but its prefix is in use...
    assert cached(tree, [1, 2]) == 2
    assert list(tree.retention.sessions) == ["run"] and tree.num_retained_pages == 2  # ...so pinned again
    tree.unlock(match)
    tree.check_integrity()


def test_an_ended_session_pins_nothing_again() -> None:
    pool, tree, _ = make()
    insert(pool, tree, [1, 2])
    tree.retain(hint("run"), [1, 2])
    tree.release("run")
    # its last request finished just after the end was drained (a cancelled straggler)
    assert not tree.retain(hint("run"), [1, 2])
    assert tree.num_retained_pages == 0 and tree.retention.sessions == {}
    tree.check_integrity()


def test_a_pin_holds_its_own_namespace_prefix() -> None:
    """A tenant's pin finds and holds the prefix in that tenant's namespace, not the default one."""
    pool, tree, _ = make()
    ns = "tenant-a"
    match = tree.match_prefix([1, 2, 3], ns)
    tree.lock(match)
    tree.cache_finished([1, 2, 3], pool.allocate(3), match, ns)
    insert(pool, tree, [1, 2, 3])  # the same tokens in the default namespace, newer
    assert tree.retain(hint("run"), [1, 2, 3], ns)
    assert tree.num_retained_pages == 3
    assert tree.evict(3) == 3  # the unpinned default-namespace copy goes first
    assert (cached(tree, [1, 2, 3]), tree.match_prefix([1, 2, 3], ns).num_tokens) == (0, 3)
    tree.check_integrity()
    assert tree.release("run") == 3
    assert tree.evict(3) == 3
    assert tree.match_prefix([1, 2, 3], ns).num_tokens == 0
    tree.check_integrity()


def test_an_ended_session_demotes_its_own_tail_not_a_shared_ancestor() -> None:
    pool, tree, _ = make()
    insert(pool, tree, [1, 2, 3, 4])  # the run's state: shared prefix [1 2], its own tail [3 4]
    tree.retain(hint("run"), [1, 2, 3, 4])
    insert(pool, tree, [7, 8])  # plain LRU, older than the shared prefix's next use
    insert(pool, tree, [1, 2])  # another request uses the shared prefix, after [7 8]
    tree.release("run")
    assert tree.evict(2) == 2  # the ended run's own tail first
    assert tree.evict(2) == 2  # then plain LRU: [7 8], not the recently used [1 2]
    assert (cached(tree, [7, 8]), cached(tree, [1, 2, 3, 4])) == (0, 2)
    tree.check_integrity()


def test_the_same_prefix_retained_twice_is_pinned_once() -> None:
    """Fork branches of one run finish on the same cached prefix: one pin, released once."""
    pool, tree, _ = make()
    insert(pool, tree, [1, 2, 3])
    assert tree.retain(hint("run"), [1, 2, 3])
    assert tree.retain(hint("run"), [1, 2, 3])
    assert tree.retain(hint("run"), [1, 2])  # covered by the deeper pin
    tree.check_integrity()
    assert len(tree.retention.sessions["run"].pins) == 1 and tree.num_retained_pages == 3
    assert tree.release("run") == 3
    assert tree.num_retained_pages == 0
    tree.check_integrity()


def test_a_live_session_gives_only_its_tail_and_keeps_the_rest_pinned() -> None:
    pool, tree, _ = make(num_pages=9, budget=8)
    insert(pool, tree, [1, 2, 3, 4])  # an agent's first turn...
    insert(pool, tree, [1, 2, 3, 4, 5, 6])  # ...and its second, one node deeper
    assert tree.retain(hint("agent"), [1, 2, 3, 4, 5, 6])
    insert(pool, tree, [7, 8])  # one-shot traffic
    tree.retain(hint("other", ttl_s=50.0), [7, 8])  # a later deadline: "agent" goes first
    assert tree.evict(2) == 2  # nothing unpinned: the agent's tail [5 6] goes...
    assert (cached(tree, [1, 2, 3, 4, 5, 6]), tree.num_retained_pages) == (4, 6)  # ...its head stays pinned
    assert [n.key for n in tree.retention.sessions["agent"].pins] == [(1, 2, 3, 4)]
    tree.release("other")
    insert(pool, tree, [9])  # newer one-shot traffic
    assert tree.evict(3) == 3  # unpinned leaves first: [7 8] (released) and [9], not the agent's head
    assert (cached(tree, [1, 2, 3, 4]), cached(tree, [7, 8]), cached(tree, [9])) == (4, 0, 0)
    tree.check_integrity()


def test_a_session_past_its_deadline_is_not_pinned_again_after_a_trim() -> None:
    pool, tree, clock = make(num_pages=7, budget=6)
    insert(pool, tree, [1, 2, 3, 4])
    insert(pool, tree, [1, 2, 3, 4, 5, 6])
    tree.retain(hint("agent", ttl_s=1.0), [1, 2, 3, 4, 5, 6])
    clock.now += 2
    assert tree.evict(2) == 2
    assert tree.retention.sessions == {} and tree.num_retained_pages == 0
    assert cached(tree, [1, 2, 3, 4]) == 4  # kept, but as plain LRU
    tree.check_integrity()
