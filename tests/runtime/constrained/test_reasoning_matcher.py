"""``ReasoningMatcher``: free thinking up to the end marker, then the inner grammar; the
budget forces the marker; rollback crosses the span's end."""

from __future__ import annotations

import pytest

from runtime.constrained import allocate_token_bitmask, allowed_token_ids
from runtime.constrained.matcher import GrammarMatcher
from runtime.constrained.reasoning import ReasoningMatcher
from runtime.errors import InvalidRequestError
from runtime.sampling.reasoning import ReasoningSpan

VOCAB = 100
EOS = 2
END = (40, 41)  # the end marker's two tokens


class OnlySevens(GrammarMatcher):
    """An inner grammar: 7 7 then the end (EOS)."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: object, row: int) -> None:
        bitmask[row] = 0  # type: ignore[index]
        word, bit = divmod(7 if len(self.accepted) < 2 else EOS, 32)
        bitmask[row, word] = 1 << bit  # type: ignore[index]

    def accept_token(self, token_id: int) -> bool:
        if token_id != (7 if len(self.accepted) < 2 else EOS):
            return False
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]

    def is_terminated(self) -> bool:
        return len(self.accepted) == 3

    def can_end(self) -> bool:
        return len(self.accepted) == 2


def allowed(matcher: GrammarMatcher) -> list[int]:
    mask = allocate_token_bitmask(1, VOCAB)
    matcher.fill_bitmask(mask, 0)
    return allowed_token_ids(mask[0], VOCAB)


def test_thinking_is_free_but_for_eos_then_the_inner_grammar_applies() -> None:
    inner = OnlySevens()
    m = ReasoningMatcher(ReasoningSpan(END), inner, [EOS])
    assert allowed(m) == [t for t in range(VOCAB) if t != EOS]
    assert not m.accept_token(EOS) and not m.can_end()
    for t in (5, 40, 9, 40, 41):  # a half marker inside the span is thinking
        assert m.accept_token(t)
    assert m.answer_start == 5 and inner.accepted == []
    assert allowed(m) == [7]
    assert not m.accept_token(8)
    assert m.accept_token(7) and m.accept_token(7) and m.can_end()
    assert m.accept_token(EOS) and m.is_terminated()


def test_without_an_inner_grammar_only_the_budget_binds() -> None:
    m = ReasoningMatcher(ReasoningSpan(END, budget=2), None, [EOS])
    assert EOS in allowed(m) and m.can_end()  # no answer grammar: the model may stop
    assert m.accept_token(11) and m.accept_token(12)
    assert allowed(m) == [40] and m.forced_tokens() == [40, 41]
    assert not m.accept_token(13)
    assert m.accept_token(40) and allowed(m) == [41] and m.accept_token(41)
    assert allowed(m) == list(range(VOCAB)) and m.answer_start == 4


def test_the_budget_counts_a_started_marker_as_marker() -> None:
    m = ReasoningMatcher(ReasoningSpan(END, budget=1), OnlySevens(), [EOS])
    assert m.accept_token(40)  # the marker's first token: not a thinking token
    assert allowed(m) != [41]
    assert m.accept_token(41) and allowed(m) == [7]
    zero = ReasoningMatcher(ReasoningSpan(END, budget=0), OnlySevens(), [EOS])
    assert allowed(zero) == [40]


def test_rollback_reopens_the_span() -> None:
    inner = OnlySevens()
    m = ReasoningMatcher(ReasoningSpan(END), inner, [EOS])
    for t in (5, 40, 41, 7):
        assert m.accept_token(t)
    m.rollback(2)  # the 7 and the marker's last token
    assert inner.accepted == [] and m.answer_start is None
    assert m.accept_token(41) and m.accept_token(7) and inner.accepted == [7]
    with pytest.raises(ValueError, match="cannot roll back"):
        m.rollback(5)


def test_a_span_needs_end_ids_and_a_sane_budget() -> None:
    with pytest.raises(InvalidRequestError, match="end_ids"):
        ReasoningSpan(())
    with pytest.raises(InvalidRequestError, match="budget"):
        ReasoningSpan((1,), budget=-1)
