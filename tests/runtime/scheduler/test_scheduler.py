"""Scheduler scenarios on a stub model runner: exact pages, order, chunking, retraction, abort.

Every scenario runs through ``sim.Sim``, which checks the page-accounting identity
(``Scheduler.check_integrity``) before and after every step.
"""

from __future__ import annotations

import pytest
from sim import Sim, decode_ids, fake_outputs, prefill_ids

from runtime.request import RequestStatus

SHARED = list(range(100, 140))  # 40 tokens: above DEDUP_MIN_TOKENS (32)


def test_exact_pages_through_prefill_decode_and_finish() -> None:
    sim = Sim(num_pages=9, page_size=2)  # 8 usable pages of 2 tokens
    a = sim.add("a", [1, 2, 3, 4, 5], max_new_tokens=3)

    batch = sim.step()  # prefill all 5 tokens into pages 1-3; sample 900
    assert prefill_ids(batch) == [("a", 0, 5)] and decode_ids(batch) == []
    assert a.pages == [1, 2, 3] and a.prefix.pages == [1, 2]  # full pages shared at once
    assert sorted(sim.cache.cached_pages()) == [1, 2] and a.own_pages == [3]

    batch = sim.step()  # token 900 at position 5 fits in page 3
    assert decode_ids(batch) == ["a"] and a.pages == [1, 2, 3]

    batch = sim.step()  # position 6 needs page 4; then a finishes at 3 outputs
    assert decode_ids(batch) == ["a"] and a.status == RequestStatus.FINISHED
    assert a.output_ids == fake_outputs(3) and a.finish_reason == "length"
    # Tokens 0-5 (3 full pages) stay cached; page 4 held only position 6 and is freed.
    assert sorted(sim.cache.cached_pages()) == [1, 2, 3]
    assert sim.pool.free_pages() == [4, 5, 6, 7, 8]
    assert sim.used_pages == 0


def test_second_request_reuses_cached_pages() -> None:
    sim = Sim(num_pages=17, page_size=2)
    sim.add("a", [1, 2, 3, 4, 5, 6], max_new_tokens=1)
    sim.run()
    b = sim.add("b", [1, 2, 3, 4, 7, 8, 9], max_new_tokens=1)
    batch = sim.step()
    assert prefill_ids(batch) == [("b", 4, 3)]  # [1 2 3 4] = pages 1, 2 from the cache
    assert b.num_cached_tokens == 4
    assert sim.sched.stats.cached_prompt_tokens == 4 and sim.sched.stats.prompt_tokens == 13
    # b's own pages were [4, 5]: [7 8] on page 4 is now cached, page 5 (just [9]) freed.
    assert sorted(sim.cache.cached_pages()) == [1, 2, 3, 4] and 5 in sim.pool.free_pages()


def test_prompt_fully_cached_still_computes_its_last_token() -> None:
    sim = Sim(num_pages=17, page_size=1)
    sim.add("a", [1, 2, 3, 4], max_new_tokens=1)
    sim.run()
    b = sim.add("b", [1, 2, 3, 4], max_new_tokens=2)
    batch = sim.step()
    assert prefill_ids(batch) == [("b", 3, 1)] and b.num_cached_tokens == 3
    sim.run()
    assert b.output_ids == fake_outputs(2)


def _admission_order(policy: str) -> list[str]:
    sim = Sim(num_pages=65, page_size=4, policy=policy, max_running=1)
    sim.add("warm", list(range(1, 13)), max_new_tokens=1)  # caches 3 pages of [1..12]
    sim.run()
    sim.add("none", [50, 51, 52, 53, 54, 55, 56, 57, 58], max_new_tokens=1)
    sim.add("one_page", [1, 2, 3, 4, 60, 61, 62, 63, 64], max_new_tokens=1)
    sim.add("three_pages", list(range(1, 13)) + [70, 71], max_new_tokens=1)
    sim.add("two_pages", list(range(1, 9)) + [80, 81, 82], max_new_tokens=1)
    order = []
    for batch in sim.run():  # max_running=1: one admission per step
        order += [i.request.request_id for i in batch.prefill]
    return order


def test_fcfs_admits_in_arrival_order() -> None:
    assert _admission_order("fcfs") == ["none", "one_page", "three_pages", "two_pages"]


def test_lpm_admits_longest_cached_prefix_first() -> None:
    assert _admission_order("lpm") == ["three_pages", "two_pages", "one_page", "none"]


def _cold_request_admission(max_overtakes: int | None) -> tuple[int, int]:
    """(step at which a cache-cold request is admitted, later arrivals admitted before
    it) while a cache-hot request arrives every step, one admission per step."""
    sim = Sim(num_pages=257, page_size=4, policy="lpm", max_running=1, lpm_max_overtakes=max_overtakes)
    sim.add("warm", list(range(1, 13)), max_new_tokens=1)
    sim.run()
    sim.add("cold", [50, 51, 52, 53, 54], max_new_tokens=1)
    ahead = 0
    for step in range(1, 41):
        sim.add(f"hot{step}", list(range(1, 13)) + [100 + step], max_new_tokens=1)
        admitted = [i.request.request_id for i in sim.step().prefill]
        if admitted == ["cold"]:
            return step, ahead
        ahead += len(admitted)
    return -1, ahead


def test_lpm_aging_bounds_how_often_a_cold_request_is_overtaken() -> None:
    assert _cold_request_admission(3) == (4, 3)
    assert _cold_request_admission(None) == (-1, 40)  # no bound (the baseline): it starves


def test_in_batch_dedup_computes_a_shared_prefix_once() -> None:
    sim = Sim(num_pages=257, page_size=1, max_prefill_tokens=256)
    reqs = [sim.add(f"r{i}", SHARED + [200 + i, 201 + i], max_new_tokens=2) for i in range(3)]
    batch = sim.step()
    assert prefill_ids(batch) == [("r0", 0, 42)]  # r1, r2 wait for r0's prefix
    batch = sim.step()
    assert prefill_ids(batch) == [("r1", 40, 2), ("r2", 40, 2)] and decode_ids(batch) == ["r0"]
    assert [r.num_cached_tokens for r in reqs] == [0, 40, 40]
    assert sim.sched.stats.prefill_tokens == 42 + 2 + 2
    sim.run()
    assert all(r.output_ids == fake_outputs(2) for r in reqs)


def test_namespaces_neither_share_nor_wait_for_each_others_prefixes() -> None:
    """A request of another cache namespace (tenant, cache_salt) never reuses r0's prefix,
    so it is not held back for it either: waiting would show its caller that someone is
    computing that prompt right now."""
    sim = Sim(num_pages=257, page_size=1, max_prefill_tokens=256)
    r0 = sim.add("r0", SHARED + [200], max_new_tokens=2, cache_namespace="a")
    other = sim.add("other", SHARED + [201], max_new_tokens=2, cache_namespace="b")
    same = sim.add("same", SHARED + [202], max_new_tokens=2, cache_namespace="a")
    assert prefill_ids(sim.step()) == [("r0", 0, 41), ("other", 0, 41)]  # "same" waits for r0
    assert prefill_ids(sim.step()) == [("same", 40, 1)]
    assert (r0.num_cached_tokens, other.num_cached_tokens, same.num_cached_tokens) == (0, 0, 40)
    late = sim.add("late", SHARED + [203], max_new_tokens=1)  # the shared default: nothing cached
    sim.run()
    assert late.num_cached_tokens == 0


def test_dedup_deferred_requests_keep_their_budget_once_the_first_decodes() -> None:
    # While r0 decodes, the prefill budget is the 4-token chunk; r1..r4 were deferred
    # from a step with 256 tokens to spare, so they all start together next step anyway.
    sim = Sim(num_pages=257, page_size=1, max_prefill_tokens=256, chunked_prefill_size=4)
    reqs = [sim.add(f"r{i}", SHARED + [200 + i, 201 + i, 202 + i], max_new_tokens=3) for i in range(5)]
    assert prefill_ids(sim.step()) == [("r0", 0, 43)]
    batch = sim.step()
    assert prefill_ids(batch) == [(f"r{i}", 40, 3) for i in range(1, 5)] and decode_ids(batch) == ["r0"]
    late = sim.add("late", list(range(300, 310)), max_new_tokens=1)  # a new arrival: chunked
    assert prefill_ids(sim.step()) == [("late", 0, 4)]
    sim.run()
    assert all(r.output_ids == fake_outputs(3) for r in reqs) and late.output_ids == fake_outputs(1)


def test_short_shared_prefix_is_not_deferred() -> None:
    sim = Sim(num_pages=257, page_size=1)
    for i in range(3):
        sim.add(f"r{i}", SHARED[:20] + [200 + i], max_new_tokens=1)
    assert prefill_ids(sim.step()) == [("r0", 0, 21), ("r1", 0, 21), ("r2", 0, 21)]


def test_chunked_prefill_interleaves_with_decode() -> None:
    sim = Sim(num_pages=65, page_size=1, max_prefill_tokens=8)
    a = sim.add("a", [1, 2, 3, 4], max_new_tokens=6)
    assert prefill_ids(sim.step()) == [("a", 0, 4)]
    b = sim.add("b", list(range(10, 30)), max_new_tokens=2)  # 20 tokens = 8 + 8 + 4
    steps = [sim.step() for _ in range(3)]
    assert [prefill_ids(s) for s in steps] == [[("b", 0, 8)], [("b", 8, 8)], [("b", 16, 4)]]
    assert [decode_ids(s) for s in steps] == [["a"], ["a"], ["a"]]  # a never stalls
    assert b.output_ids == fake_outputs(1) and len(a.output_ids) == 4
    # Each chunk's full pages were shared as soon as they were computed.
    assert b.prefix.num_tokens == 20
    steps = sim.run()
    assert [decode_ids(s) for s in steps] == [["a", "b"], ["a"]]
    assert a.output_ids == fake_outputs(6) and b.output_ids == fake_outputs(2)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_retraction_when_pages_run_out_then_resume(prefix_cache: bool) -> None:
    sim = Sim(num_pages=13, page_size=1, prefix_cache=prefix_cache)  # 12 usable pages
    a = sim.add("a", [1, 2, 3, 4], max_new_tokens=4)
    b = sim.add("b", [5, 6, 7, 8], max_new_tokens=6)
    assert prefill_ids(sim.step()) == [("a", 0, 4), ("b", 0, 4)]
    sim.step()
    sim.step()  # both hold 6 pages: the pool is full
    assert sim.pool.num_free_pages == 0 and len(b.pages) == 6
    c = sim.add("c", [9, 9], max_new_tokens=1)  # arrives later than b

    batch = sim.step()  # a and b both need a 7th page: b (admitted last) is retracted
    assert [r.request_id for r in batch.retracted] == ["b"] and decode_ids(batch) == ["a"]
    assert b.status == RequestStatus.WAITING and b.pages == [] and b.num_computed == 0
    assert b.output_ids == fake_outputs(3)  # keeps what it generated
    assert sim.sched.waiting == [b, c]  # re-queued first
    assert sim.sched.stats.num_retractions == 1 and b.num_retractions == 1
    assert a.status == RequestStatus.FINISHED  # a's 7th page came from b's released pages

    batch = sim.step()
    # b resumes: with the cache, its prompt's pages survived (eviction took the LRU leaf,
    # b's two computed outputs, for a's last page); it recomputes outputs 1-3 (positions
    # 4-6) and samples its 4th. Without a cache it recomputes everything.
    assert prefill_ids(batch) == [("b", 4, 3) if prefix_cache else ("b", 0, 7), ("c", 0, 2)]
    assert b.num_cached_tokens == 0  # counted at first admission only
    sim.run()
    assert a.output_ids == fake_outputs(4) and b.output_ids == fake_outputs(6)
    assert c.output_ids == fake_outputs(1)
    assert sim.sched.stats.num_retractions == 1 and sim.used_pages == 0
    assert sim.pool.num_free_pages + sim.cache.num_evictable_pages == 12


def test_retraction_picks_the_newest_admitted() -> None:
    sim = Sim(num_pages=16, page_size=1)  # 15 usable
    reqs = [sim.add(f"r{i}", [10 * i + 1, 10 * i + 2], max_new_tokens=8) for i in range(3)]
    retracted = [r.request_id for s in sim.run() for r in s.retracted]
    assert retracted[:1] == ["r2"]
    assert all(r.output_ids == fake_outputs(8) for r in reqs)
    assert sim.used_pages == 0


def test_abort_running_request_releases_pages_at_once() -> None:
    sim = Sim(num_pages=33, page_size=4)
    a = sim.add("a", list(range(1, 11)), max_new_tokens=10)
    sim.step()
    sim.step()
    assert a.pages == [1, 2, 3] and sim.used_pages == 3
    sim.finish(a, "abort")
    assert a.status == RequestStatus.FINISHED and a.finish_reason == "abort"
    assert a.pages == [] and sim.sched.running == [] and sim.used_pages == 0
    assert sorted(sim.cache.cached_pages()) == [1, 2]  # computed full pages stay shareable
    assert sim.sched.stats.num_aborts == 1
    sim.sched.check_integrity()


def test_abort_mid_chunked_prefill() -> None:
    sim = Sim(num_pages=65, page_size=1, max_prefill_tokens=8)
    a = sim.add("a", list(range(1, 31)), max_new_tokens=4)
    assert prefill_ids(sim.step()) == [("a", 0, 8)]
    assert prefill_ids(sim.step()) == [("a", 8, 8)]
    assert sim.used_pages == 16
    sim.finish(a, "abort")
    assert sim.used_pages == 0 and sim.sched.has_work is False
    assert sorted(sim.cache.cached_pages()) == list(range(1, 17))
    sim.sched.check_integrity()
    # The computed half is reused by the next request with the same prompt.
    b = sim.add("b", list(range(1, 31)), max_new_tokens=1)
    assert prefill_ids(sim.step()) == [("b", 16, 8)] and b.num_cached_tokens == 16


def test_abort_waiting_and_retracted_requests() -> None:
    sim = Sim(num_pages=13, page_size=1)
    a = sim.add("a", [1, 2, 3, 4], max_new_tokens=6)
    b = sim.add("b", [5, 6, 7, 8], max_new_tokens=6)
    for _ in range(4):
        batch = sim.step()
    assert batch.retracted == [b]
    waiting = sim.add("w", [9], max_new_tokens=3)
    sim.finish(b, "abort")  # retracted: holds nothing, leaves the queue
    sim.finish(waiting, "abort")
    assert sim.sched.waiting == [] and sim.sched.stats.num_aborts == 2
    sim.sched.check_integrity()
    sim.run()
    assert a.output_ids == fake_outputs(6) and b.output_ids == fake_outputs(3)
    assert sim.used_pages == 0


def test_pages_are_whole_after_a_mixed_workload() -> None:
    sim = Sim(num_pages=41, page_size=4, policy="lpm", max_prefill_tokens=16,
              decode_reserve_tokens=4)
    reqs = [sim.add(f"r{i}", SHARED[: 8 + 3 * i] + [7] * (i % 5), max_new_tokens=3 + i % 7)
            for i in range(12)]
    sim.run()
    assert all(r.output_ids == fake_outputs(r.params.max_new_tokens) for r in reqs)
    assert sim.used_pages == 0 and sim.cache.num_locked_pages == 0
    sim.cache.evict(1000)
    assert sim.pool.num_free_pages == 40


def test_decode_reserve_never_blocks_a_request_that_fits_alone() -> None:
    # Regression: 8 prompt tokens + a 16-token decode reserve > 9 usable pages, so the
    # request was never admitted and the engine spun on empty steps forever. Alone it
    # fits: the engine stops it at max_model_len = pool capacity (9 tokens here).
    sim = Sim(num_pages=10, page_size=1, decode_reserve_tokens=16)
    a = sim.add("a", list(range(1, 9)), max_new_tokens=16)
    b = sim.add("b", [50, 51], max_new_tokens=16)
    assert prefill_ids(sim.step()) == [("a", 0, 8)]  # b waits while a runs
    assert a.output_ids == fake_outputs(1) and a.finish_reason == "length"  # 9 tokens
    steps = sim.run()
    assert prefill_ids(steps[0]) == [("b", 0, 2)]
    assert b.output_ids == fake_outputs(7) and b.seq_len == 9
