"""Bounds on JSON number literals, enforced on top of any backend's grammar.

No JSON-schema backend bounds the digits of a number: llguidance 1.9's JSON options
(``x-guidance``) cover separators and whitespace only, and its ``minimum``/``maximum``
ranges fail past 64-bit integers ("Failed to generate regex for integer range") and never
bound a fraction. So a sampled ``{"type": "number"}`` can run one digit at a time until
``max_new_tokens``. ``BoundedMatcher`` wraps a backend's matcher: a small JSON lexer
follows the output (in a string or not; in a number, which part and how many digits) and
the mask loses the tokens that would take a part past its bound (``grammars.JsonBounds``).

NOTE: bounds only narrow what the grammar allows. Where they would leave no token at all
(a ``const`` or ``enum`` number longer than the bounds), the grammar's own mask stands, in
``fill_bitmask`` and ``accept_token`` alike, so the two always agree.

Lexer states are ``(mode, digits)``; ``digits`` saturates at the part's bound, so a
handful of states cover every position and each state's mask is computed once::

    OUT --'"'--> STR --'\\'--> ESC --any--> STR --'"'--> OUT
    OUT --'-'|digit--> INT --'.'--> FRAC --'e'|'E'--> EXP ('+'/'-' first, then digits)
    INT|FRAC|EXP --any other byte--> OUT (that byte read again in OUT)
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from grammars import JsonBounds
from runtime.constrained.bitmask import allocate_token_bitmask, bitmask_width
from runtime.constrained.matcher import GrammarMatcher
from runtime.constrained.token_bytes import ordinary_token_bytes

OUT, STR, ESC, INT, FRAC, EXP = range(6)
State = tuple[int, int]  # (mode, digits of the current number part, saturated at its bound)
START: State = (OUT, 0)
_DIGITS = frozenset(b"0123456789")


class NumberLexer:
    """The JSON lexer of one bounds setting: states, transitions, violations."""

    def __init__(self, bounds: JsonBounds) -> None:
        self.limit = {INT: bounds.max_int_digits, FRAC: bounds.max_frac_digits,
                      EXP: bounds.max_exp_digits}

    def advance(self, state: State, data: bytes) -> tuple[State, bool]:
        """The state after ``data``, and whether a number part went past its bound."""
        over = False
        for byte in data:
            state, past = self._step(state, byte)
            over = over or past
        return state, over

    def _step(self, state: State, byte: int) -> tuple[State, bool]:
        mode, digits = state
        if mode == STR:
            return ((ESC, 0) if byte == 0x5C else (OUT, 0) if byte == 0x22 else state), False
        if mode == ESC:
            return (STR, 0), False
        if mode in self.limit:
            if byte in _DIGITS:
                limit = self.limit[mode]
                return (mode, min(digits + 1, limit)), digits >= limit
            if byte == 0x2E and mode == INT:  # '.'
                return (FRAC, 0), False
            if byte in b"eE" and mode != EXP:
                return (EXP, 0), False
            if byte in b"+-" and mode == EXP and digits == 0:
                return state, False
        # Outside strings and numbers (or a number just ended: this byte is read here).
        if byte == 0x22:
            return (STR, 0), False
        if byte == 0x2D:  # '-'
            return (INT, 0), False
        if byte in _DIGITS:
            return (INT, 1), False
        return START, False


class BoundsTable:
    """Per tokenizer and bounds: each token's bytes, and the allowed-token mask of every
    lexer state where some token would break a bound (built lazily, then cached).

    Thread-safe: matchers of many requests share one table.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, bounds: JsonBounds) -> None:
        self.vocab_size = vocab_size
        self.lexer = NumberLexer(bounds)
        self.token_bytes: dict[int, bytes] = {}  # ordinary tokens only: special ones print nothing
        for data, ids in ordinary_token_bytes(hf_tokenizer).items():
            for token_id in ids:
                if token_id < vocab_size:
                    self.token_bytes[token_id] = data
        # NOTE: a bound breaks only on a digit, so only tokens with a digit can break one.
        self._with_digits = [t for t, data in self.token_bytes.items() if _DIGITS & set(data)]
        self._masks: dict[State, torch.Tensor | None] = {}
        self._lock = threading.Lock()

    def advance(self, state: State, token_id: int) -> tuple[State, bool]:
        """The lexer state after ``token_id``, and whether it breaks a bound."""
        data = self.token_bytes.get(token_id)
        return (state, False) if data is None else self.lexer.advance(state, data)

    def allowed(self, state: State) -> torch.Tensor | None:
        """``[W]`` int32 mask of the tokens within bounds from ``state``; None: all are."""
        with self._lock:
            if state not in self._masks:
                self._masks[state] = self._build(state)
            return self._masks[state]

    def _build(self, state: State) -> torch.Tensor | None:
        banned = [t for t in self._with_digits if self.lexer.advance(state, self.token_bytes[t])[1]]
        if not banned:
            return None
        mask = allocate_token_bitmask(1, self.vocab_size)[0]
        ids = torch.tensor(banned, dtype=torch.int64)
        words = torch.zeros(bitmask_width(self.vocab_size), dtype=torch.int64)
        words.index_add_(0, ids // 32, torch.ones_like(ids) << (ids % 32))  # distinct bits: add = or
        words = torch.where(words >= 2**31, words - 2**32, words)  # bit 31 is int32's sign bit
        return mask & ~words.to(torch.int32)


class BoundedMatcher(GrammarMatcher):
    """A backend matcher with JSON number bounds on top (see the module docstring)."""

    def __init__(self, inner: GrammarMatcher, table: BoundsTable) -> None:
        self.inner = inner
        self.table = table
        self.states: list[State] = [START]  # after each accepted token (EOS included)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)
        allowed = self.table.allowed(self.states[-1])
        if allowed is not None:
            bounded = bitmask[row] & allowed
            if bool(bounded.any()):  # NOTE: never leave the grammar without a token
                bitmask[row] = bounded

    def accept_token(self, token_id: int) -> bool:
        state, over = self.table.advance(self.states[-1], token_id)
        if over and self._bounds_leave_a_choice():
            return False
        if not self.inner.accept_token(token_id):
            return False
        self.states.append(state)
        return True

    def _bounds_leave_a_choice(self) -> bool:
        """Whether the grammar allows some token within bounds here (so bounds apply)."""
        scratch = allocate_token_bitmask(1, self.table.vocab_size)
        self.inner.fill_bitmask(scratch, 0)
        allowed = self.table.allowed(self.states[-1])
        return allowed is None or bool((scratch[0] & allowed).any())

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        if num_tokens:
            del self.states[-num_tokens:]

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def can_end(self) -> bool:
        return self.inner.can_end()

    def error(self) -> str | None:
        return self.inner.error()

    def forced_tokens(self) -> list[int]:
        # Forced bytes are the grammar's only way on, where bounds never apply (NOTE above).
        return self.inner.forced_tokens()
