"""Orders in which waiting requests are considered for admission.

A base policy (FCFS, longest prefix match) orders requests of one class. ``FairPolicy``
wraps one: priority classes first (interactive before batch), and inside a class the
tenants take turns, the tenant holding the fewest running requests first (max-min fair
share of the running slots); each tenant's own requests keep the base order.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from collections.abc import Sequence

from runtime.cache.kv_tier import TIER_HIT_WEIGHT
from runtime.cache.prefix_cache import PrefixCache
from runtime.request import Request

# Beyond this many waiting requests, LPM falls back to FCFS: matching every waiting
# request against the tree each step would cost more than the cache saves.
LPM_MAX_WAITING = 128
# LPM aging: later arrivals that may be admitted ahead of a waiting request before it goes
# first (``LongestPrefixMatchPolicy``); a couple of steps' admissions, so a cold request
# waits at most a few steps longer than it would first come, first served.
DEFAULT_MAX_OVERTAKES = 16  # EngineConfig.lpm_max_overtakes's default


class SchedulePolicy(ABC):
    @abstractmethod
    def order(self, waiting: list[Request], cache: PrefixCache,
              running: Sequence[Request] = ()) -> list[Request]:
        """The waiting requests in the order admission should try them."""

    def rank(self, request: Request) -> int:
        """The request's class (0 best): a better class is prefilled and admitted first.
        A base policy has one class."""
        return 0

    def victim(self, waiting: Request, running: Sequence[Request]) -> Request | None:
        """A running request that ``waiting`` may displace when the running batch is
        full (it is retracted and re-queued), or None. A base policy never preempts."""
        return None


class FCFSPolicy(SchedulePolicy):
    """First come, first served (retracted requests keep their original place)."""

    def order(self, waiting: list[Request], cache: PrefixCache,
              running: Sequence[Request] = ()) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival)


class LongestPrefixMatchPolicy(SchedulePolicy):
    """Longest cached prefix first (cache-aware); ties by arrival.

    Aging bounds what the cache order costs a request that matches little: once
    ``max_overtakes`` later arrivals have been admitted ahead of a waiting request
    (``Request.num_overtaken``), it goes before every request that has not waited that
    long, oldest first. Without it (None) a cache-cold request waits as long as cache-hot
    ones keep arriving (docs/benchmarks.md#lpm_aging).
    """

    def __init__(self, max_overtakes: int | None = DEFAULT_MAX_OVERTAKES) -> None:
        self.max_overtakes = max_overtakes

    def order(self, waiting: list[Request], cache: PrefixCache,
              running: Sequence[Request] = ()) -> list[Request]:
        if len(waiting) > LPM_MAX_WAITING:
            return FCFSPolicy().order(waiting, cache)
        matched = {id(r): _cached_worth(cache, r.all_ids[:-1], r.cache_namespace) for r in waiting}
        bound = self.max_overtakes

        def key(r: Request) -> tuple[int, float, int]:
            if bound is not None and r.num_overtaken >= bound:
                return (0, 0, r.arrival)  # aged: first come, first served
            return (1, -matched[id(r)], r.arrival)

        return sorted(waiting, key=key)


def _cached_worth(cache: PrefixCache, ids: list[int], namespace: str | None) -> float:
    """Cached tokens of ``ids``, a pool hit counting 1 and a tier hit ``TIER_HIT_WEIGHT``
    (a reload is a copy: cheaper than a prefill, dearer than a pool hit)."""
    pool = cache.match_prefix(ids, namespace).num_tokens
    return pool + TIER_HIT_WEIGHT * cache.tier.match(ids, namespace, pool).num_tokens


class FairPolicy(SchedulePolicy):
    """Priority classes, then tenants in turn, then ``base`` order within a tenant.

    Example, tenant A holding 3 running slots and B none, waiting ``a1 a2 b1 b2`` in base
    order, all one class: ``b1 b2 a1 a2`` until B holds as many slots as A, then they
    alternate. An interactive request displaces the newest running batch request when
    the batch is full (``victim``); requests of one class never displace each other.
    """

    def __init__(self, base: SchedulePolicy) -> None:
        self.base = base

    def rank(self, request: Request) -> int:
        return request.priority_rank

    def order(self, waiting: list[Request], cache: PrefixCache,
              running: Sequence[Request] = ()) -> list[Request]:
        base = self.base.order(waiting, cache, running)
        slots = Counter(r.tenant for r in running)
        queues: dict[tuple[int, str | None], list[Request]] = defaultdict(list)
        for r in base:
            queues[(r.priority_rank, r.tenant)].append(r)
        position = {id(r): i for i, r in enumerate(base)}
        ordered: list[Request] = []
        for rank in sorted({k[0] for k in queues}):
            ordered += _take_turns({t: q for (c, t), q in queues.items() if c == rank}, slots, position)
        return ordered

    def victim(self, waiting: Request, running: Sequence[Request]) -> Request | None:
        worse = [r for r in running if r.priority_rank > waiting.priority_rank]
        # NOTE: the worst class, newest first: it has the least work to lose.
        return max(worse, key=lambda r: (r.priority_rank, r.arrival), default=None)


def _take_turns(queues: dict[str | None, list[Request]], slots: Counter[str | None],
                position: dict[int, int]) -> list[Request]:
    """Merge per-tenant queues: next is always the tenant with the fewest slots (counting
    the ones handed out here), ties by the base order of its head."""
    heap = [(slots[t], position[id(q[0])], i, t) for i, (t, q) in enumerate(queues.items())]
    heapq.heapify(heap)
    heads = dict.fromkeys(queues, 0)
    merged = []
    while heap:
        used, _, i, tenant = heapq.heappop(heap)
        queue = queues[tenant]
        merged.append(queue[heads[tenant]])
        heads[tenant] += 1
        if heads[tenant] < len(queue):
            heapq.heappush(heap, (used + 1, position[id(queue[heads[tenant]])], i, tenant))
    return merged


def make_policy(name: str, fair: bool = False,
                lpm_max_overtakes: int | None = DEFAULT_MAX_OVERTAKES) -> SchedulePolicy:
    """The base policy ``name`` ("fcfs" | "lpm"), wrapped in ``FairPolicy`` when ``fair``;
    ``lpm_max_overtakes``: LPM's aging bound (``LongestPrefixMatchPolicy``)."""
    if name == "fcfs":
        base: SchedulePolicy = FCFSPolicy()
    elif name == "lpm":
        base = LongestPrefixMatchPolicy(lpm_max_overtakes)
    else:
        raise ValueError(f"unknown schedule policy {name!r}")
    return FairPolicy(base) if fair else base
