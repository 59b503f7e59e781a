"""The page pool: which KV pages are free. Pages are handed out and taken back in pairs.

Page 0 is the padding page and is never handed out, so a pool of ``num_pages`` holds
``num_pages - 1`` usable pages. Free pages are handed out lowest id first, always (a heap),
which keeps page ids predictable in tests and keeps the pool's resident memory at its
high-water mark: on the CPU the KV tensors are allocated untouched (``torch.empty``), so
a page costs resident memory only once written, and a freed low page is reused before an
untouched high one. (A FIFO of freed pages would walk every page of the pool in turn and
make all of it resident under any steady load; docs/memory.md.)

Pages move only under the engine's step lock (in a step, or in ``close()``), but gauges
(free, cached, used pages) are read from other threads. ``lock`` is held around every
move, and by the prefix cache around moves that span the pool and the cache (insert, then
lock), so a reader holding it sees whole moves: used = usable - free - evictable is never
off by a half-done insert or eviction.
"""

from __future__ import annotations

import heapq
import threading

# Never handed out; its K/V is zeros. Page tables pad with it, and a sliding-window model's
# request puts it where a page fell out of the window (scheduler.py).
PADDING_PAGE = 0


class OutOfPagesError(RuntimeError):
    """``allocate`` asked for more pages than are free (a scheduler bug, never user-facing)."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError("a page pool needs at least 2 pages (page 0 is padding)")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(1, num_pages))  # a heap (sorted is one)
        self._is_free = [False] + [True] * (num_pages - 1)
        self._top = 0  # the highest page id ever handed out
        self.lock = threading.RLock()

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_touched_pages(self) -> int:
        """The highest page id ever handed out: as the lowest free page goes first, every
        page up to it has held KV, so on the CPU these are the pool's resident pages (the
        padding page aside)."""
        return self._top

    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` free pages. Raises OutOfPagesError if there are not enough."""
        with self.lock:
            if num_pages > len(self._free):
                raise OutOfPagesError(f"asked for {num_pages} pages, {len(self._free)} free")
            pages = [heapq.heappop(self._free) for _ in range(num_pages)]
            for page in pages:
                self._is_free[page] = False
            if pages:
                self._top = max(self._top, pages[-1])  # NOTE: popped ascending
            return pages

    def free(self, pages: list[int]) -> None:
        """Give pages back. Freeing a free page (or page 0) is a bug and raises."""
        with self.lock:
            for page in pages:
                if page <= 0 or page >= self.num_pages or self._is_free[page]:
                    raise ValueError(f"double free or invalid page {page}")
                self._is_free[page] = True
                heapq.heappush(self._free, page)

    def free_pages(self) -> list[int]:
        """The free page ids, ascending (the order ``allocate`` hands them out)."""
        with self.lock:
            return sorted(self._free)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)
