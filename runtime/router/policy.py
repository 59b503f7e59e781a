"""Routing policies: which worker gets a request. Torch-free and synchronous, so the HTTP
router and the simulator (``benchmarks/sim_router.py``) run the same code.

``route(key, loads, candidates)`` picks one of ``candidates`` (the healthy workers'
indices) given each worker's load (requests in flight from this router) and records the
choice. Four policies:

- ``cache_aware`` (the default; SGLang's router): the worker whose prefix index holds the
  longest prefix of the key, unless that worker is overloaded — its load exceeds the least
  loaded worker's by more than ``balance_abs_threshold`` AND is more than
  ``balance_rel_threshold`` times it — then the least loaded. When no worker holds at
  least ``cache_threshold`` of the key (a new prefix), the least loaded, ties broken by
  the smallest index, so new prefixes spread over the workers' caches.
- ``round_robin``, ``least_load``: the baselines.
- ``consistent_hash``: a hash of the key's first ``hash_prefix_len`` symbols on a ring of
  virtual nodes (the usual session-affinity baseline; blind to load).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

from runtime.router.config import PolicyConfig
from runtime.router.prefix_index import PrefixIndex

# Why a request went where it did (a metrics label).
Reason = Literal["prefix", "balance", "least_load", "round_robin", "hash"]


class NoWorkerError(Exception):
    """No worker can take the request (none healthy, or all tried)."""


@dataclass(frozen=True)
class Route:
    """One routing decision."""

    worker: int  # index of the chosen worker
    reason: Reason
    matched_len: int  # key symbols the chosen worker was thought to hold (0 without a key)
    key_len: int  # symbols in the key (0 without a key)


class RoutingPolicy(ABC):
    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers

    @abstractmethod
    def route(self, key: Sequence[int] | None, loads: Sequence[int], candidates: Sequence[int]) -> Route:
        """Choose one of ``candidates`` for a request with ``key`` and record the choice.

        Raises:
            NoWorkerError: ``candidates`` is empty.
        """

    def forget(self, worker: int) -> None:  # noqa: B027 - a no-op unless the policy remembers
        """``worker`` lost its cache (it went down): drop what the policy remembers of it."""


def least_loaded(loads: Sequence[int], candidates: Sequence[int]) -> int:
    if not candidates:
        raise NoWorkerError("no healthy worker to route to")
    return min(candidates, key=lambda w: (loads[w], w))


class RoundRobin(RoutingPolicy):
    def __init__(self, num_workers: int) -> None:
        super().__init__(num_workers)
        self._turn = itertools.count()

    def route(self, key: Sequence[int] | None, loads: Sequence[int], candidates: Sequence[int]) -> Route:
        if not candidates:
            raise NoWorkerError("no healthy worker to route to")
        ordered = sorted(candidates)
        return Route(ordered[next(self._turn) % len(ordered)], "round_robin", 0, len(key or ()))


class LeastLoad(RoutingPolicy):
    def route(self, key: Sequence[int] | None, loads: Sequence[int], candidates: Sequence[int]) -> Route:
        return Route(least_loaded(loads, candidates), "least_load", 0, len(key or ()))


class ConsistentHash(RoutingPolicy):
    """A ring of ``VNODES`` points per worker; a key goes to the first candidate clockwise."""

    VNODES = 100

    def __init__(self, num_workers: int, prefix_len: int) -> None:
        super().__init__(num_workers)
        self.prefix_len = prefix_len
        self._ring = sorted((_hash(f"worker-{w}-{v}".encode()), w)
                            for w in range(num_workers) for v in range(self.VNODES))
        self._points = [h for h, _ in self._ring]

    def route(self, key: Sequence[int] | None, loads: Sequence[int], candidates: Sequence[int]) -> Route:
        if not key:
            return Route(least_loaded(loads, candidates), "least_load", 0, 0)
        allowed = set(candidates)
        if not allowed:
            raise NoWorkerError("no healthy worker to route to")
        prefix = ",".join(map(str, key[: self.prefix_len])).encode()
        start = bisect.bisect(self._points, _hash(prefix))
        for i in range(len(self._ring)):
            worker = self._ring[(start + i) % len(self._ring)][1]
            if worker in allowed:
                return Route(worker, "hash", 0, len(key))
        raise AssertionError("every worker has points on the ring")


class CacheAware(RoutingPolicy):
    def __init__(self, num_workers: int, config: PolicyConfig) -> None:
        super().__init__(num_workers)
        self.config = config
        self.indexes = [PrefixIndex(config.index_capacity) for _ in range(num_workers)]

    def route(self, key: Sequence[int] | None, loads: Sequence[int], candidates: Sequence[int]) -> Route:
        if not key:
            return Route(least_loaded(loads, candidates), "least_load", 0, 0)
        least = self._least_loaded(loads, candidates)
        matches = {w: self.indexes[w].match_len(key) for w in candidates}
        best_len = max(matches.values())
        worker, reason = least, cast(Reason, "least_load")  # a new prefix: nobody holds enough of it
        if best_len > 0 and best_len >= self.config.cache_threshold * len(key):
            best = min((w for w in candidates if matches[w] == best_len), key=lambda w: (loads[w], w))
            worker, reason = (least, "balance") if self._overloaded(loads[best], loads[least]) else (best, "prefix")
        self.indexes[worker].insert(key)
        return Route(worker, reason, matches[worker], len(key))

    def _least_loaded(self, loads: Sequence[int], candidates: Sequence[int]) -> int:
        if not candidates:
            raise NoWorkerError("no healthy worker to route to")
        return min(candidates, key=lambda w: (loads[w], self.indexes[w].num_symbols, w))

    def _overloaded(self, load: int, least_load: int) -> bool:
        c = self.config
        return load - least_load > c.balance_abs_threshold and load > c.balance_rel_threshold * least_load

    def forget(self, worker: int) -> None:
        self.indexes[worker] = PrefixIndex(self.config.index_capacity)


def make_policy(config: PolicyConfig, num_workers: int) -> RoutingPolicy:
    if num_workers < 1:
        raise ValueError("a router needs at least one worker")
    if config.policy == "cache_aware":
        return CacheAware(num_workers, config)
    if config.policy == "round_robin":
        return RoundRobin(num_workers)
    if config.policy == "least_load":
        return LeastLoad(num_workers)
    return ConsistentHash(num_workers, config.hash_prefix_len)


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
