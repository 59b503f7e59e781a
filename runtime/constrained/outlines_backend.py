"""Grammar backend on outlines-core (regex → DFA index over the whole vocabulary).

Regular constraints only: JSON schemas go through outlines-core's schema → regex
translation; Lark grammars are refused. EOS is allowed in the index's final states;
outlines-core cannot advance on EOS, so the matcher records it itself.
"""

from __future__ import annotations

from typing import Any

import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from grammars import Constraint, ConstraintError, JsonSchemaConstraint
from runtime.constrained.matcher import CompiledGrammar, GrammarBackend, GrammarMatcher
from runtime.constrained.regex_source import regex_of
from runtime.constrained.token_bytes import ordinary_token_bytes

MAX_ROLLBACK_TOKENS = 64  # how far back an outlines matcher can roll (speculation depth)


class OutlinesMatcher(GrammarMatcher):
    """Wraps one ``outlines_core.Guide`` plus an "EOS taken" flag."""

    def __init__(self, guide: outlines_core.Guide, eos_token_id: int) -> None:
        self.guide = guide
        self.eos_token_id = eos_token_id
        self.ended = False  # EOS accepted (the guide itself cannot advance on EOS)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        target.zero_()  # NOTE: the guide sets bits only for ids it knows
        if not self.ended:
            self.guide.write_mask_into(target.data_ptr(), target.numel(), 4)

    def accept_token(self, token_id: int) -> bool:
        if self.ended:
            return False
        if token_id == self.eos_token_id:
            self.ended = bool(self.guide.is_finished())
            return self.ended
        try:
            self.guide.advance(token_id, False)
        except ValueError:  # not allowed here; the state is unchanged
            return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self.ended:
            self.ended = False
            num_tokens -= 1
        if num_tokens > self.guide.get_allowed_rollback():
            raise ValueError(f"cannot roll back {num_tokens} tokens")
        if num_tokens:
            self.guide.rollback_state(num_tokens)

    def is_terminated(self) -> bool:
        if self.ended:
            return True
        return bool(self.guide.is_finished()) and self.guide.get_tokens() == [self.eos_token_id]

    def can_end(self) -> bool:
        return not self.ended and bool(self.guide.is_finished())


class OutlinesGrammar(CompiledGrammar):
    """An ``outlines_core.Index`` (the DFA over tokens, built once)."""

    def __init__(self, index: outlines_core.Index, eos_token_id: int) -> None:
        self.index = index
        self.eos_token_id = eos_token_id

    def new_matcher(self) -> GrammarMatcher:
        guide = outlines_core.Guide(self.index, max_rollback=MAX_ROLLBACK_TOKENS)
        return OutlinesMatcher(guide, self.eos_token_id)


class OutlinesBackend(GrammarBackend):
    """JSON schema, regex, choice and type constraints via outlines-core."""

    name = "outlines"

    def __init__(self, vocabulary: outlines_core.Vocabulary, vocab_size: int, eos_token_id: int):
        super().__init__(vocab_size, eos_token_id)
        self.vocabulary = vocabulary

    @classmethod
    def from_tokenizer(cls, hf_tokenizer: Any, vocab_size: int | None = None) -> OutlinesBackend:
        vocab_size = vocab_size or len(hf_tokenizer)
        eos = int(hf_tokenizer.eos_token_id)
        vocabulary = outlines_core.Vocabulary(eos, ordinary_token_bytes(hf_tokenizer))
        return cls(vocabulary, vocab_size, eos)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        regex = self._regex(constraint)
        try:
            index = outlines_core.Index(regex, self.vocabulary)
        except Exception as exc:  # outlines-core raises ValueError/RuntimeError from Rust
            raise ConstraintError(f"outlines cannot compile {constraint.kind}: {exc}") from None
        return OutlinesGrammar(index, self.eos_token_id)

    def _regex(self, constraint: Constraint) -> str:
        if isinstance(constraint, JsonSchemaConstraint):
            try:
                return str(build_regex_from_schema(constraint.schema_json))
            except Exception as exc:
                raise ConstraintError(f"outlines cannot compile json_schema: {exc}") from None
        regex = regex_of(constraint)
        if regex is None:
            raise ConstraintError(
                f"outlines backend does not support {constraint.kind} constraints "
                "(regular languages only); use the llguidance or xgrammar backend"
            )
        return regex
