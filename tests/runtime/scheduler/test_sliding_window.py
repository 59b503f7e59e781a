"""A windowed model's requests free the pages that fell out of every layer's window.

Window 4, page size 2: the next query at position ``n`` sees keys ``n - 3 .. n``, so pages
wholly before position ``n - 3`` are dead. A dropped page's slot in the page table holds
the padding page 0; the cache's pages (a locked prefix) are never dropped, so a prefix
match stays exact. ``Sim`` checks the page accounting before and after every step.
"""

from __future__ import annotations

import pytest
from sim import Sim, decode_ids, fake_outputs, prefill_ids

from runtime.cache.page_pool import PagePool
from runtime.cache.radix_tree import RadixTree
from runtime.scheduler.policy import make_policy
from runtime.scheduler.scheduler import Scheduler

PROMPT = list(range(10, 20))  # 10 tokens: pages 1-5 at page size 2


def test_without_the_cache_pages_behind_the_window_are_freed_after_prefill_and_decode() -> None:
    sim = Sim(num_pages=12, page_size=2, prefix_cache=False, window=4)
    a = sim.add("a", PROMPT, max_new_tokens=6)
    sim.step()  # prefill 0-9; next query at 10 sees 7-9 and itself: pages of 0-5 are dead
    assert a.pages == [0, 0, 0, 4, 5]
    assert sim.pool.free_pages() == [1, 2, 3, 6, 7, 8, 9, 10, 11]
    sim.step()  # position 10 takes the lowest free page; next query at 11 sees 8.. : page 4 goes
    assert a.pages == [0, 0, 0, 0, 5, 1]
    held = []
    while a.finish_reason is None:
        sim.step()
        held.append(sum(p != 0 for p in a.pages))
    assert max(held) <= 3  # ceil(window / page size) + the page being filled
    assert a.output_ids == fake_outputs(6) and sim.used_pages == 0


def test_chunked_prefill_drops_what_the_next_chunk_cannot_see() -> None:
    sim = Sim(num_pages=12, page_size=2, prefix_cache=False, window=4, max_prefill_tokens=4)
    a = sim.add("a", PROMPT, max_new_tokens=1)
    assert prefill_ids(sim.step()) == [("a", 0, 4)] and a.pages == [1, 2]  # next query at 4 sees 1..
    assert prefill_ids(sim.step()) == [("a", 4, 4)] and a.pages == [0, 0, 3, 4]  # at 8 sees 5..
    assert sim.pool.free_pages()[:2] == [1, 2]


def test_with_the_cache_the_locked_prefix_stays_whole_and_only_decode_pages_go() -> None:
    sim = Sim(num_pages=16, page_size=2, window=4)
    a = sim.add("a", PROMPT, max_new_tokens=8)
    sim.step()
    assert a.prefix.pages == [1, 2, 3, 4, 5] and a.pages == [1, 2, 3, 4, 5]  # the cache's: kept
    for _ in range(5):
        sim.step()  # positions 10-14: own pages 6, 7, 8; the first goes once 15 is next
    assert a.pages == [1, 2, 3, 4, 5, 0, 7, 8]
    sim.run()
    # On finish the cache is offered only the whole prefix before the dropped page.
    assert sorted(sim.cache.cached_pages()) == [1, 2, 3, 4, 5] and sim.used_pages == 0
    b = sim.add("b", PROMPT + fake_outputs(8), max_new_tokens=1)
    sim.step()
    assert b.num_cached_tokens == 10  # exact: never a match over a dropped page


def test_two_windowed_requests_fit_where_whole_ones_would_retract() -> None:
    sim = Sim(num_pages=10, page_size=2, window=4, prefix_cache=False, max_model_len=16)
    a = sim.add("a", PROMPT[:6], max_new_tokens=10)
    b = sim.add("b", PROMPT[4:], max_new_tokens=10)
    sim.run()
    assert a.output_ids == b.output_ids == fake_outputs(10)
    # 9 usable pages carry two 16-token requests only because windows bound each to 3 pages
    # (without the window, b is retracted once)
    assert a.num_retractions == b.num_retractions == 0


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_retracting_requests_with_dropped_pages_keeps_every_page_accounted(prefix_cache: bool) -> None:
    sim = Sim(num_pages=10, page_size=2, window=4, prefix_cache=prefix_cache, max_model_len=16)
    requests = [sim.add(name, [i * 7 + j for j in range(6)], max_new_tokens=10) for i, name in enumerate("abcd")]
    sim.run()
    assert sum(r.num_retractions for r in requests) > 0
    assert all(r.output_ids == fake_outputs(10) for r in requests) and sim.used_pages == 0


def test_decode_steps_keep_running_while_pages_are_dropped() -> None:
    sim = Sim(num_pages=12, page_size=1, window=2, prefix_cache=False)
    a = sim.add("a", [1, 2, 3], max_new_tokens=3)
    sim.step()
    assert a.pages == [0, 0, 3]
    assert decode_ids(sim.step()) == ["a"] and a.pages == [0, 0, 0, 1]


def test_a_window_below_one_is_refused() -> None:
    pool = PagePool(4, 1)
    with pytest.raises(ValueError, match="window"):
        Scheduler(pool, RadixTree(pool), make_policy("fcfs", False, None), 4, 16, 0, window=0)
