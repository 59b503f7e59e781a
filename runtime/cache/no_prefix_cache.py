"""The do-nothing prefix cache: nothing is ever shared. The baseline and test oracle."""

from __future__ import annotations

from runtime.cache.namespace import Namespace
from runtime.cache.page_pool import PagePool
from runtime.cache.prefix_cache import EMPTY_MATCH, PrefixCache, PrefixMatch
from runtime.cache.retention import Retention


class NoPrefixCache(PrefixCache):
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool

    def match_prefix(self, token_ids: list[int], namespace: Namespace = None) -> PrefixMatch:
        return EMPTY_MATCH

    def lock(self, match: PrefixMatch) -> None:
        pass

    def unlock(self, match: PrefixMatch) -> None:
        pass

    def num_unlocked_pages(self, match: PrefixMatch) -> int:
        return 0

    def cache_finished(self, token_ids: list[int], pages: list[int], match: PrefixMatch,
                       namespace: Namespace = None) -> None:
        self.pool.free(pages)

    def cache_unfinished(
        self, token_ids: list[int], pages: list[int], match: PrefixMatch, namespace: Namespace = None
    ) -> tuple[PrefixMatch, list[int]]:
        return match, pages

    def retain(self, retention: Retention, token_ids: list[int], namespace: Namespace = None) -> bool:
        return False

    def release(self, session_id: str) -> int:
        return 0

    @property
    def num_retained_pages(self) -> int:
        return 0

    @property
    def num_refused_pins(self) -> int:
        return 0

    def evict(self, num_pages: int, offload: bool = True) -> int:
        return 0

    @property
    def num_evictable_pages(self) -> int:
        return 0

    @property
    def num_locked_pages(self) -> int:
        return 0

    def cached_pages(self) -> list[int]:
        return []

    def check_integrity(self) -> None:
        pass  # holds nothing, so nothing can be inconsistent
