"""Where draft tokens come from, and when a request stops asking for them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

# A request whose prompt-lookup drafts are accepted less often than this after
# MIN_ROUNDS verify rounds stops proposing them (grammar-forced drafts always continue:
# they cost nothing to find and are almost always accepted).
MIN_ACCEPTANCE = 0.3
MIN_ROUNDS = 4


@dataclass
class SpecStats:
    """Per-request (and, summed, global) speculation counters."""

    draft_tokens: int = 0  # draft tokens sent for verification
    accepted_tokens: int = 0  # of those, accepted
    forced_tokens: int = 0  # draft tokens that came from the grammar
    verify_rounds: int = 0  # forward passes that verified at least one draft
    lookup_draft_tokens: int = 0
    lookup_accepted_tokens: int = 0
    lookup_rounds: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class DraftSource(ABC):
    name: str

    @abstractmethod
    def propose(self, token_ids: list[int], matcher: Any, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` guesses for the tokens after ``token_ids``."""


class GrammarForcedDraft(DraftSource):
    """Tokens the grammar admits as the only continuation (canonical tokenization).

    The matcher's backend never forces a token that a longer vocabulary token could
    subsume at the boundary (llguidance holds the last forced token back in that case).
    """

    name = "grammar"

    def propose(self, token_ids: list[int], matcher: Any, max_tokens: int) -> list[int]:
        if matcher is None:
            return []
        forced: list[int] = matcher.forced_tokens()
        return forced[:max_tokens]


class PromptLookupDraft(DraftSource):
    """Copy what followed the most recent earlier occurrence of the last n tokens."""

    name = "lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, token_ids: list[int], matcher: Any, max_tokens: int) -> list[int]:
        length = len(token_ids)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if length <= n:
                continue
            tail = token_ids[-n:]
            # Scan backwards for the latest earlier occurrence of the tail.
            for start in range(length - n - 1, -1, -1):
                if token_ids[start : start + n] == tail:
                    follow = token_ids[start + n : start + n + max_tokens]
                    if follow:
                        return follow
        return []


class DraftProposer:
    """Combines the sources for one engine: grammar-forced first, then prompt lookup."""

    def __init__(self, max_draft_tokens: int = 8, max_forced_tokens: int = 16) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.max_forced_tokens = max_forced_tokens
        self.forced = GrammarForcedDraft()
        self.lookup = PromptLookupDraft()

    def propose(self, token_ids: list[int], matcher: Any, stats: SpecStats, room: int) -> tuple[list[int], int]:
        """Drafts for one request, at most ``room`` tokens. Returns (drafts, num_forced)."""
        forced = self.forced.propose(token_ids, matcher, min(room, self.max_forced_tokens))
        if forced:
            return forced, len(forced)
        if not self._lookup_pays(stats):
            return [], 0
        return self.lookup.propose(token_ids, matcher, min(room, self.max_draft_tokens)), 0

    @staticmethod
    def _lookup_pays(stats: SpecStats) -> bool:
        if stats.lookup_rounds < MIN_ROUNDS:
            return True
        return stats.lookup_accepted_tokens >= MIN_ACCEPTANCE * stats.lookup_draft_tokens
