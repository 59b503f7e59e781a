"""Continuous batching over the page pool and the prefix cache.

The algorithm, once per step (``schedule``):

0. Drafts. The output processor proposes speculative drafts for decoding requests; they
   are kept only when free + evictable pages cover every decoding request's growth with
   them (speculation never costs a retraction). A request with drafts is verified.
1. Decode room. Every decoding request needs one more KV slot. If free + evictable pages
   cannot cover that, retract the most recently admitted running requests until they
   can: a retracted request's KV goes to the prefix cache, it keeps its output and is
   re-queued first in line, so it resumes from the cache (or recomputes) later.
   Priority room: while the running batch is full and a waiting request outranks a
   running one (``policy.victim``: an interactive request, a batch one), retract that one.
2. Prefill, class by class (``policy.rank``; a base policy has one class: 0). While
   only worse-class requests decode, the budget is the large one, but a worse class
   gets at most the small one whenever anything decodes or a best-class request is in
   the engine (no long batch step in front of an interactive arrival); a step that prefills a
   best-class prompt carries no worse-class work at all (their decodes wait one step),
   so an interactive request's first token costs what it costs on an idle engine. Continue
   requests whose prompt is part-way prefilled (chunked prefill), then
   admit waiting requests in policy order while the prefill token budget (small while
   others decode, so their inter-token latency holds; large otherwise), the running
   cap and the pool (free + evictable, minus decode reservations) allow. A prompt longer
   than the remaining budget is cut into chunks; running requests keep decoding in the
   same step (mixed batch). A waiting request that shares an uncached prefix with one
   admitted this step waits a step, so the prefix is computed once and then shared; the
   next step hands such requests the budget left over from the step that deferred them
   (dedup must never cost extra steps, even once the first sharer decodes).
3. Pages. Allocate the pages for everything scheduled (evicting LRU cache leaves as
   needed) and return the ``ScheduledBatch``.

After the forward pass, ``commit`` records what was computed (and how many tokens each
verify item produced), shares finished prefills through the cache and frees the pages of
rejected drafts; ``finish`` releases a request's pages. The scheduler is the only writer
of a request's pages, prefix, positions and status.

Sliding windows (``window``: every layer of the model attends to its last ``window``
positions only, as Mistral's do): after each commit a request's own pages that lie wholly
before its next query's window are freed, and its page table holds ``PADDING_PAGE`` there
(positions keep their page index; attention masks them). The cache's pages (the locked
prefix) are never dropped, so a prefix match stays exact; on release only the whole
prefix before the first dropped page is offered to the cache (docs/models.md).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from runtime.cache.kv_tier import TierMatch
from runtime.cache.page_pool import PADDING_PAGE, PagePool
from runtime.cache.prefix_cache import EMPTY_MATCH, PrefixCache, PrefixMatch
from runtime.request import Request, RequestStatus
from runtime.scheduler.batch import PrefillItem, ScheduledBatch, VerifyItem
from runtime.scheduler.budget import FixedBudget, PrefillBudget
from runtime.scheduler.policy import LPM_MAX_WAITING, SchedulePolicy
from runtime.scheduler.stats import SchedulerStats

# A waiting request sharing at least this many uncached tokens with one admitted in the
# same step is deferred one step (in-batch prefix dedup).
DEDUP_MIN_TOKENS = 32


@dataclass
class _StepBudget:
    """What is left to hand out while one step is being planned."""

    tokens: int  # prefill tokens
    pages: int  # free + evictable pages not yet promised to anything this step


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        cache: PrefixCache,
        policy: SchedulePolicy,
        max_running_requests: int,
        max_prefill_tokens: int,
        decode_reserve_tokens: int,
        chunked_prefill_size: int | None = None,
        budget: PrefillBudget | None = None,
        clock: Callable[[], float] = time.monotonic,
        window: int | None = None,
    ) -> None:
        """``window``: the attention window bounding every layer of the model (None: some
        layer reads the whole sequence, so every page stays)."""
        if window is not None and window < 1:
            raise ValueError(f"an attention window must be >= 1, got {window}")
        self.pool, self.cache, self.policy = pool, cache, policy
        self.window = window
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        # Budget while others decode (None: the same as max_prefill_tokens).
        self.chunked_prefill_size = chunked_prefill_size or max_prefill_tokens
        # The best class's prefill tokens per step (None: the fixed chunk while it decodes).
        self.budget = budget or FixedBudget(self.chunked_prefill_size, max_prefill_tokens)
        self.clock = clock  # stamps Request.arrival_s (TTFT targets count from it)
        self.decode_reserve_tokens = decode_reserve_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._live: dict[str, Request] = {}  # request id -> request, waiting or running
        self.stats = SchedulerStats()
        self._arrival = itertools.count()
        self._admission = itertools.count()
        self._admitted_at: dict[int, int] = {}  # id(request) -> admission order
        self._deferred_budget = 0  # prefill tokens owed to requests deferred by dedup

    # ---- queue --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival = next(self._arrival)
        request.arrival_s = self.clock()
        self.waiting.append(request)
        self._live[request.request_id] = request

    def find(self, request_id: str) -> Request | None:
        """The live (waiting or running) request with this id, if any."""
        return self._live.get(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def decoding(self) -> list[Request]:
        """Running requests with only their newest sampled token left to compute."""
        return [r for r in self.running if r.is_decoding]

    # ---- one step -----------------------------------------------------------------------
    def schedule(self, drafts: Mapping[str, list[int]] | None = None) -> ScheduledBatch:
        """Form this step's batch.

        Args:
            drafts: proposed speculative drafts by request id (decoding requests only).
        """
        drafts = self._drafts_that_fit(drafts or {})
        retracted = self._make_decode_room(drafts) + self._make_priority_room()
        decoding = self.decoding
        decode = [r for r in decoding if not drafts.get(r.request_id)]
        verify = [VerifyItem(r, tuple(drafts[r.request_id])) for r in decoding if drafts.get(r.request_id)]
        decode_pages = self._decode_growth(drafts)
        # NOTE: the budget protects the inter-token latency of best-class streams: while
        # only worse-class (batch) requests decode, a best-class prompt is prefilled
        # whole; worse-class prompts stay in small chunks whenever anything decodes.
        protected = [r for r in decoding if self.policy.rank(r) == 0]
        tokens = self.budget.tokens(protected, self._prefilling())
        budget = _StepBudget(max(tokens, self._deferred_budget), self._available_pages() - decode_pages)
        self._deferred_budget = 0
        best_present = any(self.policy.rank(r) == 0 for r in [*self.running, *self.waiting])
        prefill: list[PrefillItem] = []
        for rank in sorted({self.policy.rank(r) for r in [*self.running, *self.waiting]}):
            if rank > 0 and prefill:
                break  # NOTE: a step that prefills best-class prompts carries no worse-class work
            prefill += self._prefill_class(budget, rank, capped=rank > 0 and (bool(decoding) or best_present))
        if any(self.policy.rank(i.request) == 0 for i in prefill):
            decode = [r for r in decode if self.policy.rank(r) == 0]
            verify = [v for v in verify if self.policy.rank(v.request) == 0]
        self._allocate(prefill, decode, verify)
        return ScheduledBatch.build(prefill, decode, verify, retracted)

    def _prefilling(self) -> list[Request]:
        return [*self.waiting, *(r for r in self.running if not r.is_decoding)]

    def _prefill_class(self, budget: _StepBudget, rank: int, capped: bool) -> list[PrefillItem]:
        """Continue, then admit, the prefills of class ``rank``; ``capped``: at most
        ``chunked_prefill_size`` of the budget (a worse class while others decode)."""
        share = _StepBudget(min(budget.tokens, self.chunked_prefill_size) if capped else budget.tokens,
                            budget.pages)
        before = share.tokens
        items = self._continue_prefills(share, rank) + self._admit(share, rank)
        budget.tokens -= before - share.tokens
        budget.pages = share.pages
        return items

    def _drafts_that_fit(self, drafts: Mapping[str, list[int]]) -> Mapping[str, list[int]]:
        """Speculation never costs a retraction: drop every draft when pages run short."""
        return drafts if self._decode_growth(drafts) <= self._available_pages() else {}

    def _decode_growth(self, drafts: Mapping[str, list[int]]) -> int:
        """New pages the decoding requests need this step (newest token + drafts each)."""
        return sum(self._pages_to_grow(r, 1 + len(drafts.get(r.request_id, ()))) for r in self.decoding)

    def _available_pages(self) -> int:
        return self.pool.num_free_pages + self.cache.num_evictable_pages

    def _pages_to_grow(self, request: Request, num_tokens: int) -> int:
        """New pages ``request`` needs to hold ``num_tokens`` more tokens."""
        return max(0, self.pool.pages_for_tokens(request.num_computed + num_tokens) - len(request.pages))

    def _make_decode_room(self, drafts: Mapping[str, list[int]]) -> list[Request]:
        retracted: list[Request] = []
        while True:
            if self._decode_growth(drafts) <= self._available_pages() or len(self.running) <= 1:
                return retracted
            victim = max(self.running, key=lambda r: self._admitted_at[id(r)])
            self._retract(victim)
            retracted.append(victim)

    def _retract(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_retractions += 1
        self.stats.num_retractions += 1
        self.running.remove(request)
        self.waiting.insert(0, request)

    def _make_priority_room(self) -> list[Request]:
        if len(self.running) < self.max_running:
            return []
        retracted = []
        for r in self.policy.order(self.waiting, self.cache, self.running):
            victim = self.policy.victim(r, self.running)
            if victim is None:
                break
            self._retract(victim)
            retracted.append(victim)
        return retracted

    def _reserved_pages(self) -> int:
        """Pages held back for the decode growth of running requests."""
        return sum(self._reserve_for(r) for r in self.running)

    def _reserve_for(self, request: Request) -> int:
        left = request.params.max_new_tokens - len(request.output_ids)
        return self.pool.pages_for_tokens(max(0, min(self.decode_reserve_tokens, left)))

    def _continue_prefills(self, budget: _StepBudget, rank: int) -> list[PrefillItem]:
        items = []
        for r in sorted(self.running, key=lambda r: self._admitted_at[id(r)]):
            if r.is_decoding or budget.tokens <= 0 or self.policy.rank(r) != rank:
                continue
            n = min(r.num_remaining, budget.tokens)
            need = self._pages_to_grow(r, n)
            if need > budget.pages:
                break
            items.append(PrefillItem(r, r.num_computed, n))
            budget.tokens -= n
            budget.pages -= need
        return items

    def _admit(self, budget: _StepBudget, rank: int) -> list[PrefillItem]:
        items: list[PrefillItem] = []
        admitted: list[tuple[str | None, list[int]]] = []  # (namespace, ids) admitted this step
        for r in self.policy.order(self.waiting, self.cache, self.running):
            if self.policy.rank(r) != rank:
                continue
            if budget.tokens <= 0 or len(self.running) >= self.max_running:
                break
            ids = r.all_ids[: self._match_limit(r)]
            match = self.cache.match_prefix(ids, r.cache_namespace)
            tier = self.cache.tier.match(ids, r.cache_namespace, match.num_tokens)
            cached = match.num_tokens + tier.num_tokens
            # NOTE: only another request of the same namespace could serve r's prefix; deferring
            # r for one of another namespace would show r's caller that someone sent that prompt.
            same = [ids for ns, ids in admitted if ns == r.cache_namespace]
            if self._shares_uncached_prefix(r, cached, same):
                self._deferred_budget = max(self._deferred_budget, budget.tokens)  # its share now
                continue
            n = min(r.seq_len - cached, budget.tokens)
            # NOTE: reloaded pages need pool pages as computed ones do, but no prefill budget
            need = self.pool.pages_for_tokens(cached + n) - len(match.pages)
            # Locking the match takes its unlocked pages out of the evictable count.
            taken = need + self.cache.num_unlocked_pages(match)
            # NOTE: a request admitted alone skips the decode reserve: it always fits
            # (max_model_len <= pool capacity), and the reserve must not block it forever.
            reserve = self._reserve_for(r) + self._reserved_pages() if self.running else 0
            if taken + reserve > budget.pages:
                break  # the pool is full for now; later requests would starve this one
            self._start(r, match, tier)
            items.append(PrefillItem(r, r.num_computed, n))
            admitted.append((r.cache_namespace, r.all_ids))
            budget.tokens -= n
            budget.pages -= taken
        return items

    def _match_limit(self, r: Request) -> int:
        """Tokens the cache may serve: at least one must be computed to get logits, and
        prompt positions whose logprobs are wanted must be computed too."""
        limit = r.seq_len - 1
        if r.params.prompt_logprobs and not r.admitted_once:
            limit = min(limit, max(r.params.logprob_start_len, 1) - 1)
        return limit

    def _shares_uncached_prefix(self, r: Request, cached: int, admitted: list[list[int]]) -> bool:
        ids = r.all_ids
        for other in admitted:
            n = cached
            limit = min(len(ids), len(other)) - 1
            while n < limit and ids[n] == other[n]:
                n += 1
            if n - cached >= max(DEDUP_MIN_TOKENS, self.pool.page_size):
                return True
        return False

    def _start(self, r: Request, match: PrefixMatch, tier: TierMatch) -> None:
        self.cache.lock(match)
        r.prefix, r.pages, r.num_computed = match, list(match.pages), match.num_tokens
        loaded = self._reload(r, tier)
        if not r.admitted_once:
            r.num_cached_tokens, r.num_tier_cached_tokens = match.num_tokens + loaded, loaded
            self.stats.prompt_tokens += len(r.prompt_ids)
            self.stats.cached_prompt_tokens += match.num_tokens + loaded
            self.stats.tier_cached_prompt_tokens += loaded
            r.admitted_once = True
        r.status = RequestStatus.RUNNING
        self.waiting.remove(r)
        # NOTE: only LPM reads the count (its aging), and only while it orders the queue: a
        # longer one is first come, first served and is not walked per admission.
        if len(self.waiting) <= LPM_MAX_WAITING:
            for w in self.waiting:
                if w.arrival < r.arrival:
                    w.num_overtaken += 1
        self.running.append(r)
        self._admitted_at[id(r)] = next(self._admission)

    def _reload(self, r: Request, tier: TierMatch) -> int:
        """Copy ``tier``'s pages (right after ``r``'s pool prefix) into fresh pool pages of
        ``r``'s; returns the tokens reloaded (fewer than matched when a page fails its
        check: the pages from there on are ``r``'s own, to compute)."""
        if not tier.num_tokens:
            return 0
        self.cache.tier.lock(tier)  # NOTE: the eviction below stores into the tier: keep ours
        try:
            num_pages = len(tier.slots)
            if num_pages > self.pool.num_free_pages:
                self.cache.evict(num_pages - self.pool.num_free_pages)
            r.pages += self.pool.allocate(num_pages)  # NOTE: r's own now, whatever the load does
            loaded = self.cache.tier.load(tier, r.pages[-num_pages:])
        finally:
            self.cache.tier.unlock(tier)
        r.num_computed += loaded
        return loaded

    def _allocate(self, prefill: list[PrefillItem], decode: list[Request], verify: list[VerifyItem]) -> None:
        wants = [(i.request, i.num_tokens) for i in prefill] + [(r, 1) for r in decode]
        wants += [(v.request, 1 + len(v.draft_ids)) for v in verify]
        total = sum(self._pages_to_grow(r, n) for r, n in wants)
        if total > self.pool.num_free_pages:
            self.cache.evict(total - self.pool.num_free_pages)
        for r, n in wants:
            r.pages.extend(self.pool.allocate(self._pages_to_grow(r, n)))

    # ---- after the forward pass ------------------------------------------------------------
    def commit(self, batch: ScheduledBatch, num_verified: Mapping[str, int] | None = None) -> None:
        """Record the KV computed by ``batch``; share completed prefills via the cache.

        Args:
            num_verified: tokens each verify item produced, by request id (its accepted
                drafts plus the token after them; 0 when its grammar admitted none).
        """
        for item in batch.prefill:
            r = item.request
            r.num_computed += item.num_tokens
            self.stats.prefill_tokens += item.num_tokens
            computed = r.all_ids[: r.num_computed]
            r.prefix, r.pages = self.cache.cache_unfinished(computed, r.pages, r.prefix, r.cache_namespace)
            self._drop_out_of_window(r)
        for r in batch.decode:
            r.num_computed += 1
            self._drop_out_of_window(r)
        self.stats.decode_tokens += len(batch.decode)
        for v in batch.verify:
            self._commit_verify(v.request, (num_verified or {}).get(v.request.request_id, 0))
            self._drop_out_of_window(v.request)

    def _drop_out_of_window(self, request: Request) -> None:
        """Free ``request``'s own pages that no later query can see (windowed models).

        The next query is at position ``num_computed`` and sees keys from
        ``num_computed - window + 1`` on; pages wholly before that one are dead::

            pages: [ prefix (cache's, kept) | 0 0 0 (dropped) | own pages in the window ]
                     0                        len(prefix.pages)  first_live
        """
        if self.window is None:
            return
        first_live = max(0, request.num_computed - self.window + 1) // self.pool.page_size
        start = len(request.prefix.pages)
        dead = [p for p in request.pages[start:first_live] if p != PADDING_PAGE]
        if dead:
            self.pool.free(dead)
            request.pages[start:first_live] = [PADDING_PAGE] * (first_live - start)

    def _commit_verify(self, request: Request, num_tokens: int) -> None:
        """A verify pass produced ``num_tokens`` tokens for ``request``.

        The pass computed KV for the newest token and the drafts; the KV that stays valid
        covers the newest token and the accepted drafts, i.e. every produced token but
        the last (which becomes the new newest token). Pages that only held rejected
        drafts are released.
        """
        request.num_computed += num_tokens
        self.stats.decode_tokens += num_tokens
        keep = max(self.pool.pages_for_tokens(request.num_computed), len(request.prefix.pages))
        if len(request.pages) > keep:
            self.pool.free(request.pages[keep:])
            del request.pages[keep:]

    def finish(self, request: Request, aborted: bool = False) -> None:
        """Finish a running or waiting request and release its pages."""
        if request.status == RequestStatus.RUNNING:
            computed = request.all_ids[: request.num_computed]
            self._release(request)
            self.running.remove(request)
            if (retention := request.params.retention) is not None and not aborted:
                self.cache.retain(retention, computed, request.cache_namespace)  # NOTE: after the release inserted it
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self._live.pop(request.request_id, None)
        self._admitted_at.pop(id(request), None)
        if aborted:
            self.stats.num_aborts += 1

    def _release(self, request: Request) -> None:
        ids, pages = request.all_ids[: request.num_computed], request.pages
        if PADDING_PAGE in pages:  # NOTE: window-dropped pages: the cache gets the whole prefix before them
            cut = pages.index(PADDING_PAGE)
            self.pool.free([p for p in pages[cut:] if p != PADDING_PAGE])
            ids, pages = ids[: cut * self.pool.page_size], pages[:cut]
        self.cache.cache_finished(ids, pages, request.prefix, request.cache_namespace)
        request.pages, request.prefix, request.num_computed = [], EMPTY_MATCH, 0

    # ---- invariants ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + cached + requests' own pages = all usable pages, each page in one place;
        the second tier's bookkeeping too."""
        self.cache.check_integrity()
        self.cache.tier.check_integrity()
        owners: dict[int, str] = {}
        places = [("free", self.pool.free_pages()), ("cache", self.cache.cached_pages())]
        places += [(f"request {r.request_id}", self._held(r)) for r in self.running]
        for name, pages in places:
            for page in pages:
                assert page not in owners, f"page {page} held by {owners[page]} and {name}"
                owners[page] = name
        assert len(owners) == self.pool.num_usable_pages, (
            f"{self.pool.num_usable_pages - len(owners)} pages leaked"
        )
        used = self.pool.num_usable_pages - self.pool.num_free_pages - self.cache.num_evictable_pages
        own = sum(len(self._held(r)) for r in self.running)
        assert used == own + self.cache.num_locked_pages, "in-use pages miscounted"
        for r in self.waiting:
            assert not r.pages and r.prefix is EMPTY_MATCH, f"waiting request {r.request_id} holds pages"
        live = {r.request_id: r for r in [*self.waiting, *self.running]}
        assert live == self._live, "the live-request index disagrees with the queues"
        for r in self.running:
            assert PADDING_PAGE not in r.prefix.pages, f"request {r.request_id} dropped a cache page"
            if self.window is None:
                assert PADDING_PAGE not in r.pages, f"request {r.request_id} dropped a page without a window"

    @staticmethod
    def _held(request: Request) -> list[int]:
        """The pool pages ``request`` owns (its own pages, less those its window dropped)."""
        return [p for p in request.own_pages if p != PADDING_PAGE]
