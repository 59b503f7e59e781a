"""What one worker probably has cached: a capacity-bound radix tree of routing keys.

The router never sees a worker's KV cache; it remembers what it sent there. Each worker
gets a real ``RadixTree`` (the engine's own class, ``page_size`` 1, one "page" per key
symbol) over a ``PagePool`` sized to the capacity, so the router's picture ages the same
way the worker's cache does: least recently used leaves go first when it is full.

A routing key is a list of ints (``routing_key.py``): a text's code points or a prompt's
token ids, behind a namespace tag, so the simulator drives this class with token ids and
the HTTP router with text, through the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.cache.page_pool import PagePool
from runtime.cache.radix_tree import RadixTree


class PrefixIndex:
    """An approximate prefix cache of one worker, bounded to ``capacity`` key symbols."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be a positive number of key symbols, got {capacity}")
        self.capacity = capacity
        self.pool = PagePool(capacity + 1, page_size=1)  # page 0 is the pool's padding page
        self.tree = RadixTree(self.pool)

    def match_len(self, key: Sequence[int]) -> int:
        """Symbols of ``key`` this worker is thought to hold. A read: it neither splits an
        edge nor refreshes the LRU clock, so looking a key up on every worker to choose one
        ages the others' entries as the workers' own caches age them (only the chosen
        worker sees the request, through ``insert``).

        NOTE: walks the tree's nodes directly (``RadixTree.match_prefix`` touches them).
        """
        node, i = self.tree.root, 0
        while i < len(key):
            child = node.children.get((key[i],))
            if child is None:
                return i
            edge = child.key
            n, limit = 0, min(len(edge), len(key) - i)
            while n < limit and edge[n] == key[i + n]:
                n += 1
            i += n
            if n < len(edge):
                return i
            node = child
        return i

    def insert(self, key: Sequence[int]) -> int:
        """Record that the worker now holds ``key`` (its first ``capacity`` symbols);
        evict least recently used entries to make room.

        Returns:
            the symbols of ``key`` that were already held before the insert.
        """
        ids = list(key[: self.capacity])
        match = self.tree.match_prefix(ids)
        self.tree.lock(match)  # NOTE: the matched path must survive the eviction below
        missing = len(ids) - match.num_tokens
        if missing > self.pool.num_free_pages:
            self.tree.evict(missing - self.pool.num_free_pages)
        room = min(missing, self.pool.num_free_pages)
        pages = self.pool.allocate(room)
        self.tree.cache_finished(ids[: match.num_tokens + room], match.pages + pages, match)
        return match.num_tokens

    @property
    def num_symbols(self) -> int:
        """Key symbols held (for the 'smallest tree' view and the metrics)."""
        return self.pool.num_usable_pages - self.pool.num_free_pages

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        assert self.tree.num_locked_pages == 0, "a routing insert left a lock behind"
        assert self.num_symbols == self.tree.num_evictable_pages
