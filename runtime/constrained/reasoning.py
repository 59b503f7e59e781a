"""``ReasoningMatcher``: a thinking span first, then the request's grammar (if any).

A reasoning model's output is ``<thinking tokens> </think> <answer>``. Constraining the
whole output would force the answer's grammar onto the thinking (the most common
complaint about structured output with reasoning models); so the grammar starts at the
first token after the end marker::

    output:  t0 t1 ... tk  e0 e1   a0 a1 ...
             \\thinking/  \\end/   \\answer: the inner matcher sees these only/

While thinking, every token is allowed except EOS (when an answer grammar must follow);
after ``budget`` thinking tokens the rest of the end marker is forced. Without an inner
grammar the answer is free (the matcher then only enforces the budget).
"""

from __future__ import annotations

import torch

from runtime.constrained.matcher import GrammarMatcher
from runtime.sampling.reasoning import ReasoningSpan


class ReasoningMatcher(GrammarMatcher):
    """Free thinking up to ``span.end_ids``, then ``inner`` (None: a free answer).

    Args:
        eos_token_ids: refused while thinking when ``inner`` is set (an answer must come).
    """

    def __init__(self, span: ReasoningSpan, inner: GrammarMatcher | None, eos_token_ids: list[int]) -> None:
        self.span = span
        self.inner = inner
        self.eos_token_ids = eos_token_ids
        self.thinking_ids: list[int] = []  # the span so far, end marker included
        self.ended = False  # the end marker is complete: ``inner`` has the rest
        self.num_answer = 0  # tokens accepted after the span (passed to ``inner``)

    @property
    def answer_start(self) -> int | None:
        """The output position of the answer's first token; None while thinking."""
        return len(self.thinking_ids) if self.ended else None

    def _end_matched(self) -> int:
        """How many of the end marker's tokens the span ends with (a partial marker)."""
        end = self.span.end_ids
        for n in range(min(len(end), len(self.thinking_ids)), 0, -1):
            if tuple(self.thinking_ids[-n:]) == end[:n]:
                return n
        return 0

    def _forced(self) -> int | None:
        """The end marker's next token once the budget is spent, else None."""
        budget = self.span.budget
        if budget is None:
            return None
        matched = self._end_matched()
        if len(self.thinking_ids) - matched < budget:
            return None
        return self.span.end_ids[matched]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.ended:
            if self.inner is not None:
                self.inner.fill_bitmask(bitmask, row)
            else:
                bitmask[row] = -1
            return
        forced = self._forced()
        if forced is not None:
            bitmask[row] = 0
            _set_bit(bitmask, row, forced, True)
            return
        bitmask[row] = -1
        if self.inner is not None:
            for eos in self.eos_token_ids:
                _set_bit(bitmask, row, eos, False)

    def accept_token(self, token_id: int) -> bool:
        if self.ended:
            if self.inner is not None and not self.inner.accept_token(token_id):
                return False
            self.num_answer += 1
            return True
        forced = self._forced()
        if (forced is not None and token_id != forced) or (
                self.inner is not None and token_id in self.eos_token_ids):
            return False
        self.thinking_ids.append(token_id)
        self.ended = self._end_matched() == len(self.span.end_ids)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > self.num_answer + len(self.thinking_ids):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only "
                             f"{self.num_answer + len(self.thinking_ids)} were accepted")
        answer = min(num_tokens, self.num_answer)
        if answer and self.inner is not None:
            self.inner.rollback(answer)
        self.num_answer -= answer
        if rest := num_tokens - answer:
            del self.thinking_ids[-rest:]
            self.ended = self._end_matched() == len(self.span.end_ids)

    def is_terminated(self) -> bool:
        return self.ended and self.inner is not None and self.inner.is_terminated()

    def can_end(self) -> bool:
        if not self.ended:
            return self.inner is None
        return self.inner is None or self.inner.can_end()

    def error(self) -> str | None:
        return self.inner.error() if self.ended and self.inner is not None else None

    def forced_tokens(self) -> list[int]:
        if self.ended:
            return self.inner.forced_tokens() if self.inner is not None else []
        forced = self._forced()
        return [] if forced is None else list(self.span.end_ids[self._end_matched():])


def _set_bit(bitmask: torch.Tensor, row: int, token_id: int, allowed: bool) -> None:
    word, bit = divmod(token_id, 32)
    if word >= bitmask.shape[1]:
        return
    value = int(bitmask[row, word]) & 0xFFFFFFFF
    value = value | (1 << bit) if allowed else value & ~(1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # bit 31: int32's sign bit
