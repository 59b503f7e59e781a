"""Incremental detokenization with stop strings and stop regexes.

Text is emitted only when it is final: never half a UTF-8 character (the tokenizer
renders an incomplete byte sequence as U+FFFD, so we wait for more tokens), and never
text a stop could still cut: the last ``max(len(stop)) - 1`` characters are held back
until they can no longer be the start of a stop string, and text from the start of a
*partial* match of a stop regex on (the text so far ends inside a possible match, found
with the ``regex`` module's ``partial=True``) is held back until that match completes
(the text is cut at its start) or fails.

Stops are checked only once ``check_stop`` is passed (the output processor passes it
from ``min_tokens`` on): a stop string may end, and a regex match must start, in text
decoded from then on (``_stop_floor``).
"""

from __future__ import annotations

from typing import Any

import regex


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...], skip_special_tokens: bool,
                 stop_regex: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.stop_regex = [regex.compile(p) for p in stop_regex]
        self.skip_special = skip_special_tokens
        self.text = ""  # all decoded text so far (may include a stop string at the end)
        self.emitted = 0  # characters of ``text`` handed to the caller
        self._prefix_offset = 0
        self._read_offset = 0
        self._stop_floor = 0  # stops lie in text[_stop_floor - len(stop) + 1:] (min_tokens)
        self._regex_hold = 0  # text[_regex_hold:] may still be cut by a stop regex
        self._stop_due = False  # text arrived while stops were off; check at the next add
        self.stopped = False

    def add(self, token_ids: list[int], check_stop: bool = True) -> None:
        """Feed the full output token list (after appending new tokens)."""
        if self.stopped:
            return
        prefix = self._decode(token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(token_ids[self._prefix_offset :])
        if not full.endswith("\ufffd") and len(full) > len(prefix):
            self.text += full[len(prefix) :]
            # The tokens just read become the context window for the next decode.
            self._prefix_offset = self._read_offset
            self._read_offset = len(token_ids)
            if not check_stop:
                self._stop_floor = self._regex_hold = len(self.text)
            self._stop_due = True
        if check_stop and self._stop_due:
            self._check_stop()

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
        return text

    def _check_stop(self) -> None:
        self._stop_due = False
        cuts = [i for i in [self._regex_cut()] if i is not None] if self.stop_regex else []
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            found = [self.text.find(s, max(start, self._stop_floor - len(s) + 1)) for s in self.stop]
            cuts += [i for i in found if i != -1]
        if cuts:
            self.text = self.text[: min(cuts)]
            self.stopped = True

    def _regex_cut(self) -> int | None:
        """Start of the earliest complete stop-regex match (None if none); also moves
        ``_regex_hold`` to the earliest partial match (or the end of the text)."""
        pos = self._regex_hold
        full = [m.start() for p in self.stop_regex if (m := p.search(self.text, pos)) is not None]
        partial = [m.start() for p in self.stop_regex if (m := p.search(self.text, pos, partial=True)) is not None
                   and m.partial]
        self._regex_hold = min(partial, default=len(self.text))
        return min(full, default=None)

    def take(self, final: bool) -> str:
        """New text that is safe to show (everything left when ``final``)."""
        end = len(self.text)
        if not final and not self.stopped:
            if self.stop:
                end -= max(len(s) for s in self.stop) - 1
            if self.stop_regex:
                end = min(end, self._regex_hold)
            end = max(self.emitted, end)
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
