"""Random operation sequences on RadixTree agree with a page-level reference model.

The reference model keeps what the tree should hold as plain data:

- ``cached``: every cached page-aligned prefix (a token tuple whose length is a multiple
  of the page size) → the page holding its last page of tokens. The set is prefix-closed.
- ``touched``: prefix → logical time of the last operation whose path went through it
  (match, insert). Eviction removes unlocked leaf prefixes, least recently touched first.
- ``holders``: simulated requests: their tokens, page table and locked match. A prefix is
  locked while some holder's match covers it.

Operations: start (match + lock + allocate), extend (decode more tokens), finish
(``cache_finished``), unlock (give up without caching), checkpoint (``cache_unfinished``),
match, evict. Each goes through the public ``PrefixCache`` API with a real ``PagePool``;
after each one the tree's integrity check runs and the pool-level identity is checked:
free + cached + holders' own pages = every usable page, each page in exactly one place,
with the evictable/locked split equal to the model's. Evictions must free exactly the
pages the model's LRU order names.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.cache.page_pool import PagePool
from runtime.cache.prefix_cache import PrefixMatch
from runtime.cache.radix_tree import RadixTree

NUM_PAGES = 17  # 16 usable: small enough that eviction happens often


@dataclass
class Holder:
    tokens: list[int]  # tokens whose KV the holder has (all "computed")
    pages: list[int]  # page table: match.pages + own pages
    match: PrefixMatch  # locked


class Model:
    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.cached: dict[tuple[int, ...], int] = {}
        self.touched: dict[tuple[int, ...], int] = {}
        self.clock = 0

    def prefixes(self, tokens: list[int]) -> list[tuple[int, ...]]:
        """Page-aligned prefixes of ``tokens``, one per full page."""
        return [tuple(tokens[: k * self.ps]) for k in range(1, len(tokens) // self.ps + 1)]

    def match(self, tokens: list[int]) -> list[int]:
        """Pages of the longest cached prefix; touches it."""
        self.clock += 1
        pages = []
        for prefix in self.prefixes(tokens):
            if prefix not in self.cached:
                break
            pages.append(self.cached[prefix])
            self.touched[prefix] = self.clock
        return pages

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Cache the full pages of ``tokens``; returns ``pages`` entries that were duplicates."""
        self.clock += 1
        dups = []
        for prefix, page in zip(self.prefixes(tokens), pages, strict=False):
            if prefix in self.cached:
                if self.cached[prefix] != page:
                    dups.append(page)
            else:
                self.cached[prefix] = page
            self.touched[prefix] = self.clock
        return dups

    def locked(self, holders: list[Holder]) -> set[tuple[int, ...]]:
        out: set[tuple[int, ...]] = set()
        for h in holders:
            out.update(self.prefixes(h.tokens[: h.match.num_tokens]))
        return out

    def evict_order(self, holders: list[Holder]) -> list[int]:
        """Every evictable page, in the order eviction must free them."""
        cached, locked = dict(self.cached), self.locked(holders)
        order: list[int] = []
        while True:
            leaves = [p for p in cached if p not in locked and not self._has_child(p, cached)]
            if not leaves:
                return order
            # Deepest first among equal times: a node's pages share one time, and the tree
            # evicts a node's pages together, from the leaf up.
            victim = min(leaves, key=lambda p: (self.touched[p], -len(p)))
            order.append(cached.pop(victim))

    def _has_child(self, prefix: tuple[int, ...], cached: dict[tuple[int, ...], int]) -> bool:
        return any(len(p) == len(prefix) + self.ps and p[: len(prefix)] == prefix for p in cached)

    def drop(self, pages: set[int]) -> None:
        for prefix in [p for p, page in self.cached.items() if page in pages]:
            del self.cached[prefix]
            del self.touched[prefix]


class Harness:
    """Runs one operation on the tree and on the model, then checks they agree."""

    def __init__(self, page_size: int) -> None:
        self.pool = PagePool(NUM_PAGES, page_size)
        self.tree = RadixTree(self.pool)
        self.model = Model(page_size)
        self.holders: list[Holder] = []
        self.ps = page_size

    # ---- operations -------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> PrefixMatch:
        got = self.tree.match_prefix(tokens)
        want = self.model.match(tokens)
        assert got.pages == want and got.num_tokens == len(want) * self.ps
        return got

    def start(self, tokens: list[int]) -> None:
        """A request: match + lock its cached prefix, allocate pages for the rest."""
        match = self.match(tokens)
        self.tree.lock(match)
        holder = Holder(list(tokens), list(match.pages), match)
        self.holders.append(holder)  # locked from here on (the model must know for evict)
        need = self.pool.pages_for_tokens(len(tokens)) - len(match.pages)
        if need > self.pool.num_free_pages:
            self.evict(need - self.pool.num_free_pages)
        if need > self.pool.num_free_pages:  # too little left even after eviction
            assert self.tree.num_evictable_pages == 0
            self.holders.remove(holder)
            self.tree.unlock(match)
            return
        holder.pages += self.pool.allocate(need)

    def extend(self, idx: int, tokens: list[int]) -> None:
        """A holder decodes more tokens (allocating pages as they cross a page boundary)."""
        h = self.holders[idx % len(self.holders)]
        need = self.pool.pages_for_tokens(len(h.tokens) + len(tokens)) - len(h.pages)
        if need > self.pool.num_free_pages:
            self.evict(need - self.pool.num_free_pages)
        if need <= self.pool.num_free_pages:
            h.pages += self.pool.allocate(need)
            h.tokens += tokens

    def finish(self, idx: int) -> None:
        h = self.holders.pop(idx % len(self.holders))
        free_before = self.pool.num_free_pages
        dups = self.model.insert(h.tokens, h.pages)
        partial = h.pages[len(h.tokens) // self.ps :]
        self.tree.cache_finished(h.tokens, h.pages, h.match)
        assert self.pool.num_free_pages == free_before + len(dups) + len(partial)
        assert set(dups + partial) <= set(self.pool.free_pages())

    def unlock(self, idx: int) -> None:
        """A holder gives up without caching anything: unlock, free its own pages."""
        h = self.holders.pop(idx % len(self.holders))
        self.tree.unlock(h.match)
        self.pool.free(h.pages[len(h.match.pages) :])

    def checkpoint(self, idx: int) -> None:
        """cache_unfinished: share a running holder's computed pages; it keeps running."""
        h = self.holders[idx % len(self.holders)]
        dups = self.model.insert(h.tokens, h.pages)
        new_match, pages = self.tree.cache_unfinished(h.tokens, h.pages, h.match)
        aligned = len(h.tokens) // self.ps * self.ps
        want = [self.model.cached[p] for p in self.model.prefixes(h.tokens)]
        assert new_match.num_tokens == aligned and new_match.pages == want
        assert pages == want + h.pages[aligned // self.ps :]
        assert set(dups) <= set(self.pool.free_pages())
        self.model.clock += 1  # cache_unfinished re-matches the prefix it inserted
        for prefix in self.model.prefixes(h.tokens):
            self.model.touched[prefix] = self.model.clock
        h.pages, h.match = pages, new_match

    def evict(self, num_pages: int) -> None:
        order = self.model.evict_order(self.holders)
        before = set(self.tree.cached_pages())
        freed = self.tree.evict(num_pages)
        gone = before - set(self.tree.cached_pages())
        assert freed == len(gone)
        assert freed >= min(num_pages, len(order))  # frees what was asked, when it can
        assert gone == set(order[:freed]), "evicted out of LRU order or evicted a locked page"
        assert gone <= set(self.pool.free_pages())
        self.model.drop(gone)

    # ---- invariants -------------------------------------------------------------------------
    def check(self) -> None:
        self.tree.check_integrity()
        cached, free = self.tree.cached_pages(), self.pool.free_pages()
        own = [p for h in self.holders for p in h.pages[len(h.match.pages) :]]
        everything = cached + free + own
        assert sorted(everything) == list(range(1, NUM_PAGES)), "a page leaked or is held twice"
        assert sorted(cached) == sorted(self.model.cached.values())
        locked = self.model.locked(self.holders)
        assert self.tree.num_locked_pages == len(locked)
        assert self.tree.num_evictable_pages == len(self.model.cached) - len(locked)
        for h in self.holders:  # a holder's page table still maps its tokens to cache pages
            assert h.pages[: len(h.match.pages)] == [self.model.cached[p] for p in
                                                     self.model.prefixes(h.tokens[: h.match.num_tokens])]


# Token sequences drawn from a few shared stems so that prefixes overlap, split and diverge.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]


@st.composite
def token_seqs(draw: st.DrawFn) -> list[int]:
    stem = draw(st.sampled_from(STEMS))
    cut = draw(st.integers(0, len(stem)))
    tail = draw(st.lists(st.integers(1, 3), max_size=6))
    seq = stem[:cut] + tail
    return seq if seq else [1]


MATCH = st.tuples(st.just("match"), token_seqs())
EVICT = st.tuples(st.just("evict"), st.integers(1, 8))
OPS = st.one_of(
    st.tuples(st.just("start"), token_seqs()),
    MATCH,
    MATCH,  # twice as likely: a bare match must refresh LRU order on its own
    EVICT,
    st.tuples(st.just("extend"), st.integers(0, 7), st.lists(st.integers(1, 3), min_size=1, max_size=5)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("unlock"), st.integers(0, 7)),
    st.tuples(st.just("checkpoint"), st.integers(0, 7)),
    EVICT,
)


def run_ops(page_size: int, ops: list[tuple]) -> None:  # type: ignore[type-arg]
    h = Harness(page_size)
    for op in ops:
        name, args = op[0], op[1:]
        if name in ("extend", "finish", "unlock", "checkpoint") and not h.holders:
            continue
        getattr(h, name)(*args)
        h.check()
    while h.holders:  # every request ends; then everything cached is evictable
        h.finish(0)
        h.check()
    assert h.tree.num_locked_pages == 0
    while h.tree.cached_pages():  # one page at a time: the whole LRU order is checked
        h.evict(1)
        h.check()
    assert h.pool.num_free_pages == NUM_PAGES - 1 and h.tree.cached_pages() == []


PROPERTY = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(st.lists(OPS, min_size=10, max_size=50))
def test_random_ops_page_size_1(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    run_ops(1, ops)


@PROPERTY
@given(st.lists(OPS, min_size=10, max_size=50))
def test_random_ops_page_size_4(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    run_ops(4, ops)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(OPS, min_size=10, max_size=40))
def test_random_ops_page_size_16(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    # Every token x4, so the stems span whole 16-token pages and still share prefixes.
    run_ops(16, [(op[0], [t for t in op[1] for _ in range(4)]) if op[0] in ("start", "match")
                 else op for op in ops])
