"""The prefix-cache interface: token-id prefixes → KV pages, shared between requests.

Ownership rules (what ``check_integrity`` verifies):

- every usable page is in exactly one place: the pool's free list, the cache (one node),
  or one running request's own pages;
- a request's page table is ``match.pages + own pages``: the matched prefix pages belong to
  the cache and stay locked (never evicted) until the request unlocks them;
- ``cache_finished`` takes ownership of a request's own pages: they are inserted (full
  pages only) or freed; afterwards the request holds nothing.

Namespaces (``namespace.py``): a prefix inserted under one namespace is only ever matched
under the same one; every method that looks up or inserts takes it (None: the shared
default).

Locking: ``lock(node)`` increments a reference count on the node and every ancestor;
only nodes with count 0 can be evicted, leaves first, least recently used first.
Retention pins (``retention.py``) are soft: pinned pages stay evictable, but go last.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from runtime.cache.kv_tier import KVTier, NoTier
from runtime.cache.namespace import Namespace
from runtime.cache.retention import Retention


@dataclass(frozen=True)
class PrefixMatch:
    """The cached part of a token sequence."""

    num_tokens: int  # cached tokens (a multiple of the page size)
    pages: list[int] = field(default_factory=list)  # their pages, in order
    node: Any = None  # cache handle to lock/unlock (None: nothing cached)


EMPTY_MATCH = PrefixMatch(0, [], None)


class PrefixCache(ABC):
    # Where evicted pages go and come back from (``kv_tier.py``); a cache without one
    # drops them.
    tier: KVTier = NoTier()

    @abstractmethod
    def match_prefix(self, token_ids: list[int], namespace: Namespace = None) -> PrefixMatch:
        """Longest cached, page-aligned prefix of ``token_ids`` in ``namespace`` (not locked)."""

    @abstractmethod
    def lock(self, match: PrefixMatch) -> None:
        """Protect ``match``'s pages from eviction while a request uses them."""

    @abstractmethod
    def unlock(self, match: PrefixMatch) -> None:
        """Undo one ``lock``."""

    @abstractmethod
    def num_unlocked_pages(self, match: PrefixMatch) -> int:
        """Pages of ``match`` that no request has locked (locking makes them unevictable)."""

    @abstractmethod
    def cache_finished(self, token_ids: list[int], pages: list[int], match: PrefixMatch,
                       namespace: Namespace = None) -> None:
        """A request is done with ``pages`` (holding ``token_ids``' KV; ``match`` locked,
        found in ``namespace``, where the pages are inserted).

        Inserts the full pages, frees duplicates and the partial last page, unlocks
        ``match``. The caller owns nothing afterwards.
        """

    @abstractmethod
    def cache_unfinished(
        self, token_ids: list[int], pages: list[int], match: PrefixMatch, namespace: Namespace = None
    ) -> tuple[PrefixMatch, list[int]]:
        """Insert a running request's computed tokens so others in ``namespace`` can share them.

        Returns the new locked match (``match`` is unlocked) and the request's new page
        table (cache pages for the inserted prefix, then its own remaining pages).
        """

    @abstractmethod
    def retain(self, retention: Retention, token_ids: list[int], namespace: Namespace = None) -> bool:
        """Pin the cached prefix of ``token_ids`` (in ``namespace``) for ``retention``'s
        session (a request of it finished); its previous pins that this one extends are replaced. Returns
        False when nothing was pinned (nothing cached, or the owner's budget is spent)."""

    @abstractmethod
    def release(self, session_id: str) -> int:
        """The session ended: unpin its prefixes at once. Returns the pages it pinned."""

    def has_session(self, session_id: str) -> bool:
        """Whether ``session_id`` is a live retention session (it pinned something and has
        neither ended nor been dropped). A cache that pins nothing has none."""
        return False

    @property
    @abstractmethod
    def num_retained_pages(self) -> int:
        """Cached pages pinned by retention (evictable, but last)."""

    @property
    @abstractmethod
    def num_refused_pins(self) -> int:
        """Pins ``retain`` refused because their owner's budget was spent."""

    @abstractmethod
    def evict(self, num_pages: int, offload: bool = True) -> int:
        """Free up to ``num_pages`` unlocked pages to the pool: ended sessions' leaves
        first, then LRU leaves, then pinned sessions (retention.py). With ``offload`` the
        evicted pages go to the cache's second tier, if it has one (``kv_tier.py``)."""

    @property
    @abstractmethod
    def num_evictable_pages(self) -> int:
        """Cached pages that no request has locked."""

    @property
    @abstractmethod
    def num_locked_pages(self) -> int:
        """Cached pages in use by at least one request."""

    @abstractmethod
    def cached_pages(self) -> list[int]:
        """Every page the cache owns (for integrity checks)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if the cache's own bookkeeping is inconsistent."""
