"""The scheduler and a second KV tier: evicted leaves go to the tier with their whole
prefix, a tier match is reloaded into fresh pages at admission, and the longest-prefix
order counts a reloaded token between a pool hit and a miss."""

from __future__ import annotations

from sim import Sim

from runtime.cache.kv_tier import TIER_HIT_WEIGHT, KVTier, TierMatch, TierStats
from runtime.cache.namespace import Namespace

PS = 4


class MemoryTier(KVTier):
    """What the scheduler sees of a tier: which prefixes it holds (no bytes)."""

    def __init__(self) -> None:
        self.stats = TierStats()
        self.prefixes: set[tuple[Namespace, tuple[int, ...]]] = set()
        self.locks = 0
        self.loads: list[list[int]] = []  # pool pages of each load

    def match(self, token_ids: list[int], namespace: Namespace, start: int) -> TierMatch:
        n = start
        while n + PS <= len(token_ids) and (namespace, tuple(token_ids[: n + PS])) in self.prefixes:
            n += PS
        return TierMatch(start, n - start, tuple(range((n - start) // PS)))

    def lock(self, match: TierMatch) -> None:
        self.locks += 1

    def unlock(self, match: TierMatch) -> None:
        self.locks -= 1

    def load(self, match: TierMatch, pages: list[int]) -> int:
        assert self.locks > 0, "a load of an unlocked match"
        self.loads.append(list(pages))
        return match.num_tokens

    def store(self, token_ids: list[int], namespace: Namespace, pages: list[int]) -> None:
        end = len(token_ids) // PS
        for i in range(end - len(pages), end):
            self.prefixes.add((namespace, tuple(token_ids[: (i + 1) * PS])))

    @property
    def num_pages(self) -> int:
        return len(self.prefixes)

    def flush(self, timeout: float = 60.0) -> bool:
        return True

    def clear(self) -> int:
        n = len(self.prefixes)
        self.prefixes.clear()
        return n

    def check_integrity(self) -> None:
        assert self.locks == 0

    def close(self) -> None:
        pass


def test_evicted_leaves_go_to_the_tier_and_come_back_at_admission() -> None:
    tier = MemoryTier()
    sim = Sim(num_pages=65, page_size=PS, max_running=1, tier=tier)
    sim.add("warm", list(range(1, 14)), max_new_tokens=1)  # 13 prompt + 1 output: 3 full pages cached
    sim.run()
    assert sim.cache.evict(64) == 3
    assert (None, tuple(range(1, 13))) in tier.prefixes and tier.num_pages == 3
    again = sim.add("again", list(range(1, 14)) + [99], max_new_tokens=1)
    batch = sim.step()
    [item] = batch.prefill
    assert (item.start, item.num_tokens) == (12, 2)  # 12 reloaded, the rest computed
    assert again.num_cached_tokens == again.num_tier_cached_tokens == 12
    assert tier.loads == [[1, 2, 3]]  # the lowest free pages
    sim.run()
    assert sim.sched.stats.tier_cached_prompt_tokens == 12


def test_another_namespace_finds_nothing_in_the_tier() -> None:
    tier = MemoryTier()
    sim = Sim(num_pages=65, page_size=PS, max_running=1, tier=tier)
    sim.add("a", list(range(1, 14)), max_new_tokens=1, cache_namespace="a")
    sim.run()
    sim.cache.evict(64)
    other = sim.add("b", list(range(1, 14)), max_new_tokens=1, cache_namespace="b")
    sim.run()
    assert other.num_cached_tokens == 0 and not tier.loads


def test_lpm_counts_a_reloaded_token_between_a_pool_hit_and_a_miss() -> None:
    assert 0 < TIER_HIT_WEIGHT < 1
    tier = MemoryTier()
    sim = Sim(num_pages=65, page_size=PS, policy="lpm", max_running=1, tier=tier)
    sim.add("warm", list(range(1, 13)), max_new_tokens=1)  # 3 pool pages of [1..12]
    sim.run()
    tier.store(list(range(20, 32)), None, [0, 0, 0])  # 3 tier pages of [20..31]
    tier.store(list(range(40, 48)), None, [0, 0])  # 2 of [40..47]
    sim.add("none", [50, 51, 52, 53, 54, 55, 56, 57, 58], max_new_tokens=1)
    sim.add("tier_two", list(range(40, 48)) + [80], max_new_tokens=1)
    sim.add("pool_two", list(range(1, 9)) + [81], max_new_tokens=1)
    sim.add("tier_three", list(range(20, 32)) + [82], max_new_tokens=1)
    order = []
    for batch in sim.run():  # max_running=1: one admission per step
        order += [i.request.request_id for i in batch.prefill]
    # 12 reloaded tokens (worth 9) before 8 pool-cached ones, before 8 reloaded (worth 6)
    assert order == ["tier_three", "pool_two", "tier_two", "none"]
