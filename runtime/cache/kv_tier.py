"""A second KV tier beyond the pool: pages the radix tree evicts, kept to be reloaded.

The pool is the first tier. When the radix tree evicts a leaf, it hands the leaf's pages
to the tier (``store``) before freeing them; a later request whose prefix runs past what
the pool still holds asks the tier for the pages that follow (``match``) and, once
admitted, copies them back into fresh pool pages (``load``) instead of recomputing them::

    prompt:  [ pool match (radix tree) | tier match (reloaded) | computed ]
             0                  match.num_tokens          + tier.num_tokens

A tier hit costs a copy, a pool hit nothing, a miss a prefill: the scheduler counts a
reloaded token as ``TIER_HIT_WEIGHT`` of a pool-cached one when it orders the queue.

``NoTier`` is the do-nothing tier (the default, and the baseline). The disk tier of the CPU
path (``runtime/model/disk_tier.py``) keeps its pages in a memory-mapped file; its
bookkeeping (keys, slots, LRU, locks) is ``tier_index.py``. This module stays torch-free.

Locking: a match is locked from admission until its pages are loaded (``lock`` /
``unlock``), so a store that evicts inside the tier in between never takes its slots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from runtime.cache.namespace import Namespace

# What a reloaded token is worth to the scheduler's longest-prefix order, next to a pool
# hit (1) and a miss (0): a reload is a copy, far cheaper than a prefill but not free.
TIER_HIT_WEIGHT = 0.75


@dataclass(frozen=True)
class TierMatch:
    """Pages the tier holds right after a pool match."""

    start: int  # tokens before them (the pool match; a multiple of the page size)
    num_tokens: int  # tokens they hold (a multiple of the page size)
    slots: tuple[int, ...] = ()  # the tier's handles, one per page, in order
    keys: tuple[bytes, ...] = field(default=(), repr=False)  # their page keys (tier_index.py)


def empty_tier_match(start: int) -> TierMatch:
    return TierMatch(start, 0)


@dataclass
class TierStats:
    """Counters of a tier's life (read by the metrics, written by the engine thread)."""

    stored_pages: int = 0  # pages written (or being written) to the tier
    loaded_pages: int = 0  # pages copied back into the pool
    dropped_pages: int = 0  # evicted pages the tier did not take (full of locked pages, writer behind)
    corrupt_pages: int = 0  # pages whose checksum failed on a reload (dropped; recomputed instead)


class KVTier(ABC):
    """Where evicted pages go, and come back from."""

    stats: TierStats

    @abstractmethod
    def match(self, token_ids: list[int], namespace: Namespace, start: int) -> TierMatch:
        """The pages the tier holds for ``token_ids`` right after its first ``start`` tokens
        (page-aligned; the pool's match), in ``namespace``. Not locked."""

    @abstractmethod
    def lock(self, match: TierMatch) -> None:
        """Keep ``match``'s pages in the tier until ``unlock`` (between admission and load)."""

    @abstractmethod
    def unlock(self, match: TierMatch) -> None:
        """Undo one ``lock``."""

    @abstractmethod
    def load(self, match: TierMatch, pages: list[int]) -> int:
        """Copy ``match``'s pages into the pool ``pages`` (one each, in order).

        Returns the tokens loaded: all of ``match``'s, or fewer when a page failed its
        integrity check (the pages from it on hold nothing valid and must be computed).
        """

    @abstractmethod
    def store(self, token_ids: list[int], namespace: Namespace, pages: list[int]) -> None:
        """The pool evicts ``pages``, which hold the last ``len(pages)`` pages of
        ``token_ids`` (page-aligned: the whole path from the namespace's root). Copies what
        the tier lacks before returning (the pages are freed right after); the write to
        the tier's medium happens in the background."""

    @property
    @abstractmethod
    def num_pages(self) -> int:
        """Pages the tier holds."""

    @abstractmethod
    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every store has reached the medium (tests, benchmarks); False on timeout."""

    @abstractmethod
    def clear(self) -> int:
        """Drop every unlocked page; returns how many."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if the tier's bookkeeping is inconsistent (call when idle)."""

    @abstractmethod
    def close(self) -> None:
        """Stop background work and release the medium. Idempotent."""


class NoTier(KVTier):
    """No second tier: evicted pages are simply dropped."""

    def __init__(self) -> None:
        self.stats = TierStats()

    def match(self, token_ids: list[int], namespace: Namespace, start: int) -> TierMatch:
        return empty_tier_match(start)

    def lock(self, match: TierMatch) -> None:
        pass

    def unlock(self, match: TierMatch) -> None:
        pass

    def load(self, match: TierMatch, pages: list[int]) -> int:
        assert match.num_tokens == 0, "NoTier matched nothing"
        return 0

    def store(self, token_ids: list[int], namespace: Namespace, pages: list[int]) -> None:
        pass

    @property
    def num_pages(self) -> int:
        return 0

    def flush(self, timeout: float = 60.0) -> bool:
        return True

    def clear(self) -> int:
        return 0

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        pass
