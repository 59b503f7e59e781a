"""Radix tree over token ids → KV pages (SGLang's RadixAttention, page-aligned).

Each edge holds a run of tokens whose length is a multiple of the page size, and the
pages that hold their KV (one page per ``page_size`` tokens). Children are keyed by the
tokens of their first page, so a lookup costs one dict probe per edge::

    root ─[a b c d | e f g h]─ n1 ─[i j k l]─ n2        page_size = 4
                               └──[x y z w]─ n3        n1.pages = [p0, p1]

A partial match splits an edge at a page boundary. Reference counts (``lock_ref``) run
along the root path: a node is evictable only when its count is 0 and it is a leaf.

Each cache namespace (``namespace.py``: a tenant, a ``cache_salt``) has a root of its own,
made on its first insert and dropped when its last leaf is evicted; ``root`` is the shared
default's (namespace None). A lookup starts at its namespace's root, so it never reaches
another namespace's pages. Eviction is one LRU over all of them.

Eviction never walks the tree: the evictable leaves are kept in a set as locks, inserts
and evictions change them, and a heap orders them by last access. A touch (a match or an
insert passing through) pushes a fresh heap entry instead of updating the old one; entries
whose node has left the set or been touched since are skipped when popped, and the heap
is rebuilt from the set when stale entries outnumber live ones.

Retention (``runtime/cache/retention.py``) pins prefixes for sessions: ``pin_ref`` runs
along the root path like ``lock_ref``, and a pinned node is never in the evictable-leaf
set. Its pages still count as evictable: once no unpinned leaf is left, ``evict`` unpins
sessions (earliest deadline first), takes what it needs from their tails, and pins again
what a live one has left (``_repin``); an ended session's pinned nodes (not their shared
ancestors) are demoted to the front of the LRU order. The
``max_evictable_pages`` bound below counts pinned pages too: past it, pins are soft.

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
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from runtime.cache.kv_tier import KVTier, NoTier
from runtime.cache.namespace import Namespace
from runtime.cache.page_pool import PagePool
from runtime.cache.prefix_cache import EMPTY_MATCH, PrefixCache, PrefixMatch
from runtime.cache.retention import RetainedSession, Retention, RetentionTable

F = TypeVar("F", bound=Callable[..., Any])


def _whole_move(method: F) -> F:
    """Run a method that moves pages (or page counts) under ``PagePool.lock``."""

    @functools.wraps(method)
    def locked(self: RadixTree, *args: Any, **kwargs: Any) -> Any:
        with self.pool.lock:
            return method(self, *args, **kwargs)

    return cast(F, locked)


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "pin_ref")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None) -> None:
        self.key = key  # edge tokens, len == len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.lock_ref = 0  # requests using this node or a descendant
        self.last_access = 0  # logical clock, for LRU eviction
        self.pin_ref = 0  # retention pins on this node or a descendant (retention.py)


class RadixTree(PrefixCache):
    """Args:
        max_evictable_pages: what the tree keeps for finished requests, in pages (None: the
            pool is the bound); past it, LRU leaves go as soon as they are unlocked.
        retention_max_pages: each retention owner's pin budget in pages (None: a quarter
            of the pool).
        clock: seconds, for retention deadlines.
        tier: where evicted pages go (``kv_tier.py``; NoTier: they are dropped).
    """

    def __init__(self, pool: PagePool, max_evictable_pages: int | None = None,
                 retention_max_pages: int | None = None,
                 clock: Callable[[], float] = time.monotonic, tier: KVTier | None = None) -> None:
        if max_evictable_pages is not None and max_evictable_pages < 0:
            raise ValueError(f"max_evictable_pages must be >= 0 or None, got {max_evictable_pages}")
        self.pool = pool
        self.max_evictable_pages = max_evictable_pages  # None: the pool is the bound
        self.page_size = pool.page_size
        self.root = _Node((), [], None)
        self.root.lock_ref = 1  # the root is never evicted
        # NOTE: every root has parent None and lock_ref 1; the default one is never dropped
        self._roots: dict[Namespace, _Node] = {None: self.root}
        self._namespace_of: dict[_Node, Namespace] = {self.root: None}
        self._clock = itertools.count(1)
        self._evictable = 0
        self._locked = 0
        self._leaves: set[_Node] = set()  # evictable leaves: unlocked, childless, not the root
        self._heap: list[tuple[int, int, _Node]] = []  # (last_access, push order, node)
        self._pushes = itertools.count()
        self.retention = RetentionTable(clock)
        self.retention_max_pages = retention_max_pages or max(1, pool.num_usable_pages // 4)
        self._retained = 0  # pages of pinned nodes
        self.tier = tier or NoTier()

    # ---- lookup -------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], namespace: Namespace = None) -> PrefixMatch:
        ps = self.page_size
        tokens = tuple(token_ids[: len(token_ids) // ps * ps])
        root = self._roots.get(namespace)
        if root is None:
            return EMPTY_MATCH
        node, pages, i = root, [], 0
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
        if node is root:
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
        upper.lock_ref, upper.last_access, upper.pin_ref = child.lock_ref, child.last_access, child.pin_ref
        child.key, child.pages, child.parent = child.key[n:], child.pages[n // ps :], upper
        upper.children[child.key[:ps]] = child
        parent.children[upper.key[:ps]] = upper
        return upper

    # ---- locking ------------------------------------------------------------------------
    @_whole_move
    def lock(self, match: PrefixMatch) -> None:
        node = match.node
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
                self._locked += len(node.pages)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    @_whole_move
    def unlock(self, match: PrefixMatch) -> None:
        node = match.node
        while node is not None and node.parent is not None:
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
        while node is not None and node.parent is not None:
            count += len(node.pages) if node.lock_ref == 0 else 0
            node = node.parent
        return count

    # ---- insertion ----------------------------------------------------------------------
    def _root_for(self, namespace: Namespace) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node((), [], None)
            root.lock_ref = 1
            self._namespace_of[root] = namespace
        return root

    def _insert(self, tokens: tuple[int, ...], pages: list[int], namespace: Namespace) -> int:
        """Insert page-aligned ``tokens`` → ``pages``; return how many were already cached."""
        if not tokens:
            return 0  # NOTE: before _root_for, so no namespace root is left without children
        ps, node, i = self.page_size, self._root_for(namespace), 0
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
    def cache_finished(self, token_ids: list[int], pages: list[int], match: PrefixMatch,
                       namespace: Namespace = None) -> None:
        ps = self.page_size
        aligned = min(len(token_ids), len(pages) * ps) // ps * ps
        present = self._insert(tuple(token_ids[:aligned]), pages[: aligned // ps], namespace)
        # Pages between our locked prefix and what was already cached are duplicates of
        # pages someone else inserted meanwhile; the partial last page is never cached.
        self.pool.free(pages[match.num_tokens // ps : present // ps] + pages[aligned // ps :])
        self.unlock(match)

    @_whole_move
    def cache_unfinished(
        self, token_ids: list[int], pages: list[int], match: PrefixMatch, namespace: Namespace = None
    ) -> tuple[PrefixMatch, list[int]]:
        ps = self.page_size
        aligned = len(token_ids) // ps * ps
        present = self._insert(tuple(token_ids[:aligned]), pages[: aligned // ps], namespace)
        self.pool.free(pages[match.num_tokens // ps : present // ps])
        new_match = self.match_prefix(token_ids[:aligned], namespace)
        assert new_match.num_tokens == aligned
        self.lock(new_match)
        self.unlock(match)
        return new_match, new_match.pages + pages[aligned // ps :]

    # ---- retention ----------------------------------------------------------------------
    @_whole_move
    def retain(self, retention: Retention, token_ids: list[int], namespace: Namespace = None) -> bool:
        node = self.match_prefix(token_ids, namespace).node
        session = self.retention.session(retention)
        if session is None:  # it ended
            return False
        for stale in self.retention.expired(retention.owner):
            if stale is not session:
                self._drop(stale)
        if node is None or node.parent is None:  # nothing of it is cached
            return False
        if any(self._is_ancestor(node, p) for p in session.pins):
            return True  # already held: by this very pin (fork branches share it) or a deeper one
        # Pins this one extends (an agent's previous turn) are covered by it: replaced.
        kept = [p for p in session.pins if not self._is_ancestor(p, node)]
        others = [p for s in self.retention.of_owner(retention.owner) if s is not session for p in s.pins]
        pages = self._path_pages([*others, *kept, node])
        if pages > self.retention_max_pages:
            self.retention.refuse(session, pages, self.retention_max_pages)
            return False
        self._pin_path(node, +1)
        for p in session.pins:
            if p not in kept:
                self._pin_path(p, -1)
        session.pins = [*kept, node]
        return True

    @_whole_move
    def release(self, session_id: str) -> int:
        session = self.retention.end(session_id)
        if session is None:
            return 0
        before = self._retained
        self._drop(session)
        return before - self._retained

    def has_session(self, session_id: str) -> bool:
        return session_id in self.retention.sessions

    def _drop(self, session: RetainedSession) -> None:
        """Unpin every prefix of ``session``; what it alone held goes first on eviction."""
        self.retention.pop(session.session_id)
        for node in session.pins:
            self._pin_path(node, -1, demote=True)

    def _pin_path(self, node: _Node, delta: int, demote: bool = False) -> None:
        """Add ``delta`` pins along ``node``'s root path; nodes left unpinned are put back
        among the evictable leaves. With ``demote`` (its session ended) the pinned node
        itself goes first in line; its ancestors keep their recency, since other requests
        (a shared system prompt's) may use them."""
        pinned = node
        while node.parent is not None:  # up to its namespace's root
            node.pin_ref += delta
            assert node.pin_ref >= 0, "unpin without pin"
            if node.pin_ref == delta > 0:
                self._retained += len(node.pages)
                self._leaves.discard(node)
            elif node.pin_ref == 0:
                self._retained -= len(node.pages)
                if demote and node is pinned:
                    node.last_access = 0
                self._refresh(node)
            assert node.parent is not None
            node = node.parent

    def _is_ancestor(self, upper: _Node, lower: _Node) -> bool:
        """Whether ``upper`` is ``lower`` or on its root path."""
        node: _Node | None = lower
        while node is not None and node is not upper:
            node = node.parent
        return node is upper

    def _path_pages(self, nodes: list[_Node]) -> int:
        """Pages on the union of the root paths of ``nodes``."""
        seen: set[int] = set()
        total = 0
        for node in nodes:
            while node.parent is not None and id(node) not in seen:
                seen.add(id(node))
                total += len(node.pages)
                assert node.parent is not None
                node = node.parent
        return total

    @property
    def num_retained_pages(self) -> int:
        return self._retained

    @property
    def num_refused_pins(self) -> int:
        return self.retention.num_refused

    # ---- eviction -----------------------------------------------------------------------
    @_whole_move
    def evict(self, num_pages: int, offload: bool = True) -> int:
        freed = 0
        trimmed: list[RetainedSession] = []
        while freed < num_pages:
            if not self._leaves:
                victim = self.retention.next_victim()  # NOTE: pins go only when nothing else can
                if victim is None:
                    break
                self._drop(victim)  # its pinned node is demoted: the session gives its tail first
                trimmed.append(victim)
                continue
            access, _, leaf = heapq.heappop(self._heap)
            if leaf not in self._leaves or leaf.last_access != access:
                continue  # stale: evicted, locked, grown a child or touched since the push
            parent = leaf.parent
            assert parent is not None
            if offload:  # NOTE: before the free: the tier copies the pages out
                self.tier.store(self._path_tokens(leaf), self._namespace_of[self._root_of(parent)], leaf.pages)
            self.pool.free(leaf.pages)
            freed += len(leaf.pages)
            self._evictable -= len(leaf.pages)
            self._leaves.remove(leaf)
            del parent.children[leaf.key[: self.page_size]]
            self._refresh(parent)
            if parent.parent is None and not parent.children and parent is not self.root:
                del self._roots[self._namespace_of.pop(parent)]  # a namespace's last leaf
        for session in trimmed:
            self._repin(session)
        return freed

    def _repin(self, session: RetainedSession) -> None:
        """Pin again what eviction left of a live session it had to unpin.

        A session is unpinned whole when the pool needs its pages, but eviction takes only
        what it needs, from the session's tail; the head it leaves stays pinned, so the
        next shortage takes unpinned traffic before it (unpinned, the head would be the
        oldest leaf in the tree, first to go). A session past its deadline stays dropped.
        """
        if session.deadline <= self.retention.clock():
            return
        left = {id(n): n for n in (self._surviving(p) for p in session.pins) if n is not None}
        pins = [n for n in left.values() if not any(o is not n and self._is_ancestor(n, o) for o in left.values())]
        if pins and self.retention.restore(session):
            session.pins = pins
            for node in pins:
                self._pin_path(node, +1)

    def _surviving(self, node: _Node) -> _Node | None:
        """The deepest node of ``node``'s root path still in the tree (None: none is)."""
        ps = self.page_size
        while node.parent is not None and node.parent.children.get(node.key[:ps]) is not node:
            node = node.parent
        if node.parent is None:
            return None
        root = self._root_of(node)
        return node if self._roots.get(self._namespace_of.get(root)) is root else None

    def _path_tokens(self, node: _Node) -> list[int]:
        """The tokens from ``node``'s namespace root to the end of its edge."""
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return [t for key in reversed(keys) for t in key]

    def _root_of(self, node: _Node) -> _Node:
        while node.parent is not None:
            node = node.parent
        return node

    def _refresh(self, node: _Node) -> None:
        """Put ``node`` in or out of the evictable leaves after its lock or children changed."""
        if node.parent is not None and node.lock_ref == 0 and node.pin_ref == 0 and not node.children:
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
        out, stack = [], list(self._roots.values())
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
            if node.parent is None:
                assert node.lock_ref == 1 and (node.children or node is self.root), "a stale namespace root"
                continue
            assert node.parent is not None and node.parent.children.get(node.key[:ps]) is node
            assert len(node.key) == len(node.pages) * ps and node.pages, "edge/page mismatch"
            assert node.lock_ref >= max((c.lock_ref for c in node.children.values()), default=0)
            if node.lock_ref == 0:
                evictable += len(node.pages)
            else:
                locked += len(node.pages)
        leaves = {n for n in self._nodes()
                  if n.parent is not None and n.lock_ref == 0 and n.pin_ref == 0 and not n.children}
        assert leaves == self._leaves, "the evictable-leaf set drifted from the tree"
        live = {n for access, _, n in self._heap if n in leaves and n.last_access == access}
        assert live == leaves, "an evictable leaf has no current heap entry"
        assert (evictable, locked) == (self._evictable, self._locked), (
            f"page counters drifted: walked {(evictable, locked)}, kept {(self._evictable, self._locked)}"
        )
        assert {self._roots[ns]: ns for ns in self._roots} == self._namespace_of, "namespace roots drifted"
        pages = self.cached_pages()
        assert len(pages) == len(set(pages)), "a page is cached twice"
        self._check_pins()

    def _check_pins(self) -> None:
        """Pin counts equal the sessions' pins on each root path; the retained counter agrees."""
        expected: dict[int, int] = {}
        for session in self.retention.sessions.values():
            for pin in session.pins:
                node: _Node | None = pin
                while node is not None and node.parent is not None:
                    expected[id(node)] = expected.get(id(node), 0) + 1
                    node = node.parent
        nodes = [n for n in self._nodes() if n.parent is not None]
        for node in nodes:
            assert node.pin_ref == expected.pop(id(node), 0), "a node's pin count drifted from the sessions"
        assert not expected, "a session pins a node that left the tree"
        assert self._retained == sum(len(n.pages) for n in nodes if n.pin_ref), "retained pages miscounted"
