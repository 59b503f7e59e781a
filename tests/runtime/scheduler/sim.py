"""A stub model runner for scheduler tests: schedule, "compute", sample, finish.

``Sim.step`` does what ``runtime/engine.py`` does around a forward pass, without torch:
``schedule()``, ``commit(batch)``, then one fake token for every request that samples
(prefill items that complete, and every decode request), finishing a request with
"length" when it has ``max_new_tokens`` outputs or reaches ``max_model_len`` tokens. ``check_integrity()`` runs before and
after every step.

The fake token depends only on the request's position in its output (``900 + i``), so a
retracted request that resumes must end with exactly the tokens it would have had.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runtime.cache.kv_tier import KVTier
from runtime.cache.no_prefix_cache import NoPrefixCache
from runtime.cache.page_pool import PagePool
from runtime.cache.prefix_cache import PrefixCache
from runtime.cache.radix_tree import RadixTree
from runtime.output.request_output import FinishReason
from runtime.request import Priority, Request
from runtime.sampling.params import SamplingParams
from runtime.scheduler.batch import ScheduledBatch
from runtime.scheduler.budget import PrefillBudget
from runtime.scheduler.policy import DEFAULT_MAX_OVERTAKES, make_policy
from runtime.scheduler.scheduler import Scheduler

FIRST_FAKE_TOKEN = 900


def fake_outputs(n: int) -> list[int]:
    return [FIRST_FAKE_TOKEN + i for i in range(n)]


class Sim:
    def __init__(
        self,
        num_pages: int,
        page_size: int = 1,
        *,
        policy: str = "fcfs",
        prefix_cache: bool = True,
        max_running: int = 16,
        max_prefill_tokens: int = 64,
        chunked_prefill_size: int | None = None,  # None: max_prefill_tokens
        decode_reserve_tokens: int = 0,
        max_model_len: int | None = None,
        fair: bool = False,
        lpm_max_overtakes: int | None = DEFAULT_MAX_OVERTAKES,
        budget: PrefillBudget | None = None,  # None: the fixed chunk
        clock: Callable[[], float] = time.monotonic,
        window: int | None = None,  # every layer's attention window (None: full attention)
        tier: KVTier | None = None,  # the cache's second tier (None: none)
    ) -> None:
        self.pool = PagePool(num_pages, page_size)
        # Like the engine: a request stops at max_model_len tokens, at most the pool's capacity.
        self.max_model_len = max_model_len or (num_pages - 1) * page_size
        self.cache: PrefixCache = RadixTree(self.pool, tier=tier) if prefix_cache else NoPrefixCache(self.pool)
        self.sched = Scheduler(self.pool, self.cache, make_policy(policy, fair, lpm_max_overtakes), max_running,
                               max_prefill_tokens, decode_reserve_tokens, chunked_prefill_size,
                               budget, clock, window)
        self.finished: list[Request] = []

    def add(self, rid: str, prompt_ids: list[int], max_new_tokens: int, *,
            tenant: str | None = None, priority: Priority = "interactive",
            cache_namespace: str | None = None) -> Request:
        req = Request(rid, list(prompt_ids), SamplingParams(max_new_tokens=max_new_tokens,
                                                            temperature=0.0),
                      tenant=tenant, priority=priority, cache_namespace=cache_namespace)
        self.sched.add(req)
        return req

    def step(self) -> ScheduledBatch:
        self.sched.check_integrity()
        batch = self.sched.schedule()
        self.sched.check_integrity()
        if batch.empty:
            return batch
        self.sched.commit(batch)
        sampling = [i.request for i in batch.prefill if i.completes] + list(batch.decode)
        for req in sampling:  # mirrors OutputProcessor.emit / _append_token
            if req.params.max_new_tokens == 0:
                self.finish(req, "length")
                continue
            req.output_ids.append(FIRST_FAKE_TOKEN + len(req.output_ids))
            if len(req.output_ids) >= req.params.max_new_tokens or req.seq_len >= self.max_model_len:
                self.finish(req, "length")
        self.sched.check_integrity()
        return batch

    def finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason  # as the output processor does, before releasing it
        self.sched.finish(req, aborted=reason == "abort")
        self.finished.append(req)
        self.sched.check_integrity()

    def run(self, max_steps: int = 1000) -> list[ScheduledBatch]:
        batches: list[ScheduledBatch] = []
        while self.sched.has_work:
            assert len(batches) < max_steps, "no progress"
            batch = self.step()
            assert not batch.empty, "a step scheduled nothing while requests wait: livelock"
            batches.append(batch)
        return batches

    @property
    def used_pages(self) -> int:
        """Pages neither free nor evictable (what ``metrics()['kv_pages_used']`` reports)."""
        return self.pool.num_usable_pages - self.pool.num_free_pages - self.cache.num_evictable_pages


def prefill_ids(batch: ScheduledBatch) -> list[tuple[str, int, int]]:
    """(request id, start, num_tokens) of each prefill item."""
    return [(i.request.request_id, i.start, i.num_tokens) for i in batch.prefill]


def decode_ids(batch: ScheduledBatch) -> list[str]:
    return [r.request_id for r in batch.decode]
