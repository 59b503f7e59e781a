"""Radix tree over token ids → KV pages (SGLang's RadixAttention, page-aligned).

Each edge holds a run of tokens whose length is a multiple of the page size, and the
pages that hold their KV (one page per ``page_size`` tokens). Children are keyed by the
tokens of their first page, so a lookup costs one dict probe per edge::

    root ─[a b c d | e f g h]─ n1 ─[i j k l]─ n2        page_size = 4
                               └──[x y z w]─ n3        n1.pages = [p0, p1]

A partial match splits an edge at a page boundary. Reference counts (``lock_ref``) run
along the root path: a node is evictable only when its count is 0 and it is a leaf.

Eviction never walks the tree: the evictable leaves are kept in a set as locks, inserts
and evictions change them, and a heap orders them by last access. A touch (a match or an
insert passing through) pushes a fresh heap entry instead of updating the old one; entries
whose node has left the set or been touched since are skipped when popped, and the heap
is rebuilt from the set when stale entries outnumber live ones.

``max_evictable_pages`` bounds what the tree keeps for finished requests: past it, the
least recently used leaves are evicted as soon as an unlock makes them evictable, rather
than only when the pool runs short. On the CPU the KV pool is touched lazily, so every
cached page is resident memory; without a bound a steady load fills the whole pool with
stale prefixes and the process's RSS grows by the pool's size (docs/memory.md).
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from runtime.cache.page_pool import PagePool
from runtime.cache.prefix_cache import EMPTY_MATCH, PrefixCache, PrefixMatch

F = TypeVar("F", bound=Callable[..., Any])


def _whole_move(method: F) -> F:
    """Run a method that moves pages (or page counts) under ``PagePool.lock``."""

    @functools.wraps(method)
    def locked(self: RadixTree, *args: Any, **kwargs: Any) -> Any:
        with self.pool.lock:
            return method(self, *args, **kwargs)

    return cast(F, locked)


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None) -> None:
        self.key = key  # edge tokens, len == len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.lock_ref = 0  # requests using this node or a descendant
        self.last_access = 0  # logical clock, for LRU eviction


class RadixTree(PrefixCache):
    def __init__(self, pool: PagePool, max_evictable_pages: int | None = None) -> None:
        if max_evictable_pages is not None and max_evictable_pages < 0:
            raise ValueError(f"max_evictable_pages must be >= 0 or None, got {max_evictable_pages}")
        self.pool = pool
        self.max_evictable_pages = max_evictable_pages  # None: the pool is the bound
        self.page_size = pool.page_size
        self.root = _Node((), [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self._evictable = 0
        self._locked = 0
        self._leaves: set[_Node] = set()  # evictable leaves: unlocked, childless, not the root
        self._heap: list[tuple[int, int, _Node]] = []  # (last_access, push order, node)
        self._pushes = itertools.count()

    # ---- lookup -------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        ps = self.page_size
        tokens = tuple(token_ids[: len(token_ids) // ps * ps])
        node, pages, i = self.root, [], 0
        now = next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i : i + ps])
            if child is None:
                break
            n = self._common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            pages.extend(child.pages)
            i += n
            node = child
            self._touch(node, now)
        if node is self.root:
            return EMPTY_MATCH
        return PrefixMatch(i, pages, node)

    def _common_len(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        """Tokens shared by ``key`` and ``tokens[start:]``, rounded down to whole pages."""
        n = 0
        limit = min(len(key), len(tokens) - start)
        while n < limit and key[n] == tokens[start + n]:
            n += 1
        return n // self.page_size * self.page_size

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node."""
        ps, parent = self.page_size, child.parent
        assert parent is not None and 0 < n < len(child.key) and n % ps == 0
        upper = _Node(child.key[:n], child.pages[: n // ps], parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.key, child.pages, child.parent = child.key[n:], child.pages[n // ps :], upper
        upper.children[child.key[:ps]] = child
        parent.children[upper.key[:ps]] = upper
        return upper

    # ---- locking ------------------------------------------------------------------------
    @_whole_move
    def lock(self, match: PrefixMatch) -> None:
        node = match.node
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
                self._locked += len(node.pages)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    @_whole_move
    def unlock(self, match: PrefixMatch) -> None:
        node = match.node
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.pages)
                self._locked -= len(node.pages)
                self._refresh(node)
            node = node.parent
        if self.max_evictable_pages is not None and self._evictable > self.max_evictable_pages:
            self.evict(self._evictable - self.max_evictable_pages)

    def num_unlocked_pages(self, match: PrefixMatch) -> int:
        node, count = match.node, 0
        while node is not None and node is not self.root:
            count += len(node.pages) if node.lock_ref == 0 else 0
            node = node.parent
        return count

    # ---- insertion ----------------------------------------------------------------------
    def _insert(self, tokens: tuple[int, ...], pages: list[int]) -> int:
        """Insert page-aligned ``tokens`` → ``pages``; return how many were already cached."""
        ps, node, i = self.page_size, self.root, 0
        now = next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i : i + ps])
            if child is None:
                leaf = _Node(tokens[i:], pages[i // ps :], node)
                leaf.last_access = now
                node.children[leaf.key[:ps]] = leaf
                self._evictable += len(leaf.pages)
                self._refresh(leaf)
                self._refresh(node)  # no longer a leaf
                return i
            n = self._common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            node, i = child, i + n
            self._touch(node, now)
        return i

    @_whole_move
    def cache_finished(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> None:
        ps = self.page_size
        aligned = min(len(token_ids), len(pages) * ps) // ps * ps
        present = self._insert(tuple(token_ids[:aligned]), pages[: aligned // ps])
        # Pages between our locked prefix and what was already cached are duplicates of
        # pages someone else inserted meanwhile; the partial last page is never cached.
        self.pool.free(pages[match.num_tokens // ps : present // ps] + pages[aligned // ps :])
        self.unlock(match)

    @_whole_move
    def cache_unfinished(
        self, token_ids: list[int], pages: list[int], match: PrefixMatch
    ) -> tuple[PrefixMatch, list[int]]:
        ps = self.page_size
        aligned = len(token_ids) // ps * ps
        present = self._insert(tuple(token_ids[:aligned]), pages[: aligned // ps])
        self.pool.free(pages[match.num_tokens // ps : present // ps])
        new_match = self.match_prefix(token_ids[:aligned])
        assert new_match.num_tokens == aligned
        self.lock(new_match)
        self.unlock(match)
        return new_match, new_match.pages + pages[aligned // ps :]

    # ---- eviction -----------------------------------------------------------------------
    @_whole_move
    def evict(self, num_pages: int) -> int:
        freed = 0
        while freed < num_pages and self._leaves:
            access, _, leaf = heapq.heappop(self._heap)
            if leaf not in self._leaves or leaf.last_access != access:
                continue  # stale: evicted, locked, grown a child or touched since the push
            parent = leaf.parent
            assert parent is not None
            self.pool.free(leaf.pages)
            freed += len(leaf.pages)
            self._evictable -= len(leaf.pages)
            self._leaves.remove(leaf)
            del parent.children[leaf.key[: self.page_size]]
            self._refresh(parent)
        return freed

    def _refresh(self, node: _Node) -> None:
        """Put ``node`` in or out of the evictable leaves after its lock or children changed."""
        if node is not self.root and node.lock_ref == 0 and not node.children:
            if node not in self._leaves:
                self._leaves.add(node)
                self._push(node)
        else:
            self._leaves.discard(node)

    def _touch(self, node: _Node, now: int) -> None:
        node.last_access = now
        if node in self._leaves:
            self._push(node)

    def _push(self, node: _Node) -> None:
        if len(self._heap) > 2 * len(self._leaves) + 64:  # mostly stale: rebuild
            self._heap = [(n.last_access, next(self._pushes), n) for n in self._leaves if n is not node]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (node.last_access, next(self._pushes), node))

    def _nodes(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ---- accounting ---------------------------------------------------------------------
    @property
    def num_evictable_pages(self) -> int:
        return self._evictable

    @property
    def num_locked_pages(self) -> int:
        return self._locked

    def cached_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def check_integrity(self) -> None:
        ps, evictable, locked = self.page_size, 0, 0
        for node in self._nodes():
            if node is self.root:
                continue
            assert node.parent is not None and node.parent.children.get(node.key[:ps]) is node
            assert len(node.key) == len(node.pages) * ps and node.pages, "edge/page mismatch"
            assert node.lock_ref >= max((c.lock_ref for c in node.children.values()), default=0)
            if node.lock_ref == 0:
                evictable += len(node.pages)
            else:
                locked += len(node.pages)
        leaves = {n for n in self._nodes() if n is not self.root and n.lock_ref == 0 and not n.children}
        assert leaves == self._leaves, "the evictable-leaf set drifted from the tree"
        live = {n for access, _, n in self._heap if n in leaves and n.last_access == access}
        assert live == leaves, "an evictable leaf has no current heap entry"
        assert (evictable, locked) == (self._evictable, self._locked), (
            f"page counters drifted: walked {(evictable, locked)}, kept {(self._evictable, self._locked)}"
        )
        pages = self.cached_pages()
        assert len(pages) == len(set(pages)), "a page is cached twice"
