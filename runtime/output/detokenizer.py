"""Incremental detokenization with stop strings.

Text is emitted only when it is final: never half a UTF-8 character (the tokenizer
renders an incomplete byte sequence as U+FFFD, so we wait for more tokens), and never a
prefix of a stop string that might still complete (the last ``max(len(stop)) - 1``
characters are held back until they can no longer be the start of a stop string).
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special = skip_special_tokens
        self.text = ""  # all decoded text so far (may include a stop string at the end)
        self.emitted = 0  # characters of ``text`` handed to the caller
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False

    def add(self, token_ids: list[int]) -> None:
        """Feed the full output token list (after appending new tokens)."""
        if self.stopped:
            return
        prefix = self._decode(token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(token_ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return  # wait: an incomplete character, or nothing new yet
        self.text += full[len(prefix) :]
        # The tokens just read become the context window for the next decode.
        self._prefix_offset = self._read_offset
        self._read_offset = len(token_ids)
        self._check_stop()

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
        return text

    def _check_stop(self) -> None:
        if not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        start = max(0, self.emitted - longest)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if hits:
            self.text = self.text[: min(i for i, _ in hits)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """New text that is safe to show (everything left when ``final``)."""
        end = len(self.text)
        if not final and not self.stopped and self.stop:
            end = max(self.emitted, end - (max(len(s) for s in self.stop) - 1))
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def finish(self, token_ids: list[int]) -> None:
        """Flush: decode what is left even if it ends mid-character."""
        if self.stopped:
            return
        rest = self._decode(token_ids[self._prefix_offset :])
        prefix = self._decode(token_ids[self._prefix_offset : self._read_offset])
        if len(rest) > len(prefix):
            self.text += rest[len(prefix) :]
            self._check_stop()
