"""Where draft tokens come from (whether they are verified: ``gate.py``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from runtime.constrained.matcher import GrammarMatcher


@dataclass
class SpecStats:
    """Per-request (and, summed, global) speculation counters."""

    draft_tokens: int = 0  # draft tokens sent for verification
    accepted_tokens: int = 0  # of those, accepted
    forced_tokens: int = 0  # draft tokens that came from the grammar
    verify_rounds: int = 0  # forward passes that verified at least one draft

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class Proposal:
    """Drafts for one request and where they came from."""

    draft_ids: list[int]
    source: str  # the DraftSource's name
    forced: bool  # grammar-forced: verified whatever the gate thinks of lookups


class DraftSource(ABC):
    name: str

    @abstractmethod
    def propose(self, token_ids: list[int], matcher: GrammarMatcher | None, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` guesses for the tokens after ``token_ids``."""


class GrammarForcedDraft(DraftSource):
    """Tokens the grammar admits as the only continuation (canonical tokenization).

    The matcher's backend never forces a token that a longer vocabulary token could
    subsume at the boundary (llguidance holds the last forced token back in that case).
    """

    name = "grammar"

    def propose(self, token_ids: list[int], matcher: GrammarMatcher | None, max_tokens: int) -> list[int]:
        if matcher is None:
            return []
        forced: list[int] = matcher.forced_tokens()
        return forced[:max_tokens]


class PromptLookupDraft(DraftSource):
    """Copy what followed the most recent earlier occurrence of the last n tokens."""

    name = "lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, token_ids: list[int], matcher: GrammarMatcher | None, max_tokens: int) -> list[int]:
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


class TextLookupDraft:
    """Prompt lookup on text: copy what followed the output's tail in the prompt text.

    Token n-grams miss copies whose tokenization differs from the source: a JSON value
    starts with ``"Maria`` while the document holds `` Maria``. Matching the output's last
    characters in the prompt's text finds the copy anyway; the text that followed is then
    tokenized on its own (a boundary token may differ from what the model would pick, which
    only lowers acceptance: verification keeps the output exact).
    """

    name = "text_lookup"

    def __init__(self, tokenizer: Any, max_tail_chars: int = 24, min_tail_chars: int = 4,
                 follow_chars: int = 48) -> None:
        self.tokenizer = tokenizer
        self.max_tail, self.min_tail, self.follow = max_tail_chars, min_tail_chars, follow_chars

    def propose(self, prompt_text: str, output_text: str, max_tokens: int) -> list[int]:
        for n in range(min(self.max_tail, len(output_text)), self.min_tail - 1, -1):
            at = prompt_text.rfind(output_text[-n:])
            if at < 0:
                continue
            follow = prompt_text[at + n : at + n + self.follow]
            if not follow:
                return []
            ids: list[int] = self.tokenizer.encode(follow, add_special_tokens=False)
            # The last token may be cut mid-word by the character window: drop it.
            return ids[: max(0, min(len(ids) - 1, max_tokens))]
        return []


class DraftProposer:
    """Combines the sources for one engine: grammar-forced first, then prompt lookup
    (text, then token n-grams)."""

    def __init__(self, tokenizer: Any = None, max_draft_tokens: int = 8, max_forced_tokens: int = 16) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.max_forced_tokens = max_forced_tokens
        self.forced = GrammarForcedDraft()
        self.lookup = PromptLookupDraft()
        self.text_lookup = TextLookupDraft(tokenizer) if tokenizer is not None else None

    def propose(self, token_ids: list[int], matcher: GrammarMatcher | None, room: int,
                texts: tuple[str, str] | None = None, lookup: bool = True) -> Proposal | None:
        """Drafts for one request, at most ``room`` tokens, or None.

        ``texts`` is (prompt text, output text so far), for text-level lookup; ``lookup``:
        False proposes grammar-forced drafts only.
        """
        forced = self.forced.propose(token_ids, matcher, min(room, self.max_forced_tokens))
        if forced:
            return Proposal(forced, self.forced.name, forced=True)
        if not lookup:
            return None
        limit = min(room, self.max_draft_tokens)
        if self.text_lookup is not None and texts is not None and (
                drafts := self.text_lookup.propose(texts[0], texts[1], limit)):
            return Proposal(drafts, self.text_lookup.name, forced=False)
        if drafts := self.lookup.propose(token_ids, matcher, limit):
            return Proposal(drafts, self.lookup.name, forced=False)
        return None
