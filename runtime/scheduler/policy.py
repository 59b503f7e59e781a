"""Orders in which waiting requests are considered for admission."""

from __future__ import annotations

from abc import ABC, abstractmethod

from runtime.cache.prefix_cache import PrefixCache
from runtime.request import Request

# Beyond this many waiting requests, LPM falls back to FCFS: matching every waiting
# request against the tree each step would cost more than the cache saves.
LPM_MAX_WAITING = 128


class SchedulePolicy(ABC):
    @abstractmethod
    def order(self, waiting: list[Request], cache: PrefixCache) -> list[Request]:
        """The waiting requests in the order admission should try them."""


class FCFSPolicy(SchedulePolicy):
    """First come, first served (retracted requests keep their original place)."""

    def order(self, waiting: list[Request], cache: PrefixCache) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival)


class LongestPrefixMatchPolicy(SchedulePolicy):
    """Longest cached prefix first (cache-aware); ties by arrival."""

    def order(self, waiting: list[Request], cache: PrefixCache) -> list[Request]:
        if len(waiting) > LPM_MAX_WAITING:
            return FCFSPolicy().order(waiting, cache)
        matched = {id(r): cache.match_prefix(r.all_ids[:-1]).num_tokens for r in waiting}
        return sorted(waiting, key=lambda r: (-matched[id(r)], r.arrival))


def make_policy(name: str) -> SchedulePolicy:
    if name == "fcfs":
        return FCFSPolicy()
    if name == "lpm":
        return LongestPrefixMatchPolicy()
    raise ValueError(f"unknown schedule policy {name!r}")
