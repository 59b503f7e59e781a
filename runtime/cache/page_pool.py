"""The page pool: which KV pages are free. Pages are handed out and taken back in pairs.

Page 0 is the padding page and is never handed out, so a pool of ``num_pages`` holds
``num_pages - 1`` usable pages. Free pages are handed out lowest id first (a FIFO of
freed pages after that), which keeps page ids predictable in tests.

Pages move only under the engine's step lock (in a step, or in ``close()``), but gauges
(free, cached, used pages) are read from other threads. ``lock`` is held around every
move, and by the prefix cache around moves that span the pool and the cache (insert, then
lock), so a reader holding it sees whole moves: used = usable - free - evictable is never
off by a half-done insert or eviction.
"""

from __future__ import annotations

import threading
from collections import deque


class OutOfPagesError(RuntimeError):
    """``allocate`` asked for more pages than are free (a scheduler bug, never user-facing)."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError("a page pool needs at least 2 pages (page 0 is padding)")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))
        self._is_free = [False] + [True] * (num_pages - 1)
        self.lock = threading.RLock()

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` free pages. Raises OutOfPagesError if there are not enough."""
        with self.lock:
            if num_pages > len(self._free):
                raise OutOfPagesError(f"asked for {num_pages} pages, {len(self._free)} free")
            pages = [self._free.popleft() for _ in range(num_pages)]
            for page in pages:
                self._is_free[page] = False
            return pages

    def free(self, pages: list[int]) -> None:
        """Give pages back. Freeing a free page (or page 0) is a bug and raises."""
        with self.lock:
            for page in pages:
                if page <= 0 or page >= self.num_pages or self._is_free[page]:
                    raise ValueError(f"double free or invalid page {page}")
                self._is_free[page] = True
                self._free.append(page)

    def free_pages(self) -> list[int]:
        return list(self._free)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)
