"""Grammar backend on xgrammar (pushdown automaton with a precomputed token cache)."""

from __future__ import annotations

from typing import Any

import torch
import xgrammar as xgr

from grammars import Constraint, ConstraintError, GrammarConstraint, JsonSchemaConstraint
from runtime.constrained.bitmask import bitmask_width
from runtime.constrained.matcher import CompiledGrammar, GrammarBackend, GrammarMatcher
from runtime.constrained.regex_source import regex_of


class XGrammarMatcher(GrammarMatcher):
    """Wraps one ``xgrammar.GrammarMatcher``; counts accepted tokens for rollback checks."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int, eos_token_id: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.num_accepted = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if not 0 <= token_id < self.vocab_size or self.matcher.is_terminated():
            return False
        ok = bool(self.matcher.accept_token(token_id))
        self.num_accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        # Complete: terminated iff EOS is the only token left (read off the mask).
        row = torch.zeros(1, bitmask_width(self.vocab_size), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(row, 0)
        eos_word, eos_bit = divmod(self.eos_token_id, 32)
        row[0, eos_word] &= ~(1 << eos_bit)
        return not bool(row.any())

    def can_end(self) -> bool:
        return bool(self.matcher.is_completed()) and not self.matcher.is_terminated()


class XGrammarGrammar(CompiledGrammar):
    """An ``xgrammar.CompiledGrammar``."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, eos_token_id: int):
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def new_matcher(self) -> GrammarMatcher:
        matcher = xgr.GrammarMatcher(self.compiled)
        return XGrammarMatcher(matcher, self.vocab_size, self.eos_token_id)


class XGrammarBackend(GrammarBackend):
    """JSON schema, regex, choice, type and Lark grammars via xgrammar."""

    name = "xgrammar"

    def __init__(self, compiler: xgr.GrammarCompiler, vocab_size: int, eos_token_id: int):
        super().__init__(vocab_size, eos_token_id)
        self.compiler = compiler

    @classmethod
    def from_tokenizer(cls, hf_tokenizer: Any, vocab_size: int | None = None) -> XGrammarBackend:
        vocab_size = vocab_size or len(hf_tokenizer)
        eos = int(hf_tokenizer.eos_token_id)
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=[eos]
        )
        # NOTE: xgrammar's own cache is off: GrammarCompiler caches by constraint key.
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return cls(compiler, vocab_size, eos)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        try:
            compiled = self._compile(constraint)
        except ConstraintError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with C++ text
            raise ConstraintError(f"xgrammar cannot compile {constraint.kind}: {exc}") from None
        return XGrammarGrammar(compiled, self.vocab_size, self.eos_token_id)

    def _compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        if isinstance(constraint, JsonSchemaConstraint):
            # strict_mode=False keeps the standard JSON-schema meaning (extra properties
            # allowed unless the schema forbids them), as llguidance does.
            # Same layout as llguidance_backend.JSON_LAYOUT: one line, ", " and ": ".
            return self.compiler.compile_json_schema(
                constraint.schema_json, any_whitespace=False, separators=(", ", ": "),
                strict_mode=False,
            )
        if isinstance(constraint, GrammarConstraint):
            return self.compiler.compile_lark(constraint.lark_text)
        regex = regex_of(constraint)
        if regex is None:
            raise ConstraintError(f"xgrammar backend does not support {constraint.kind}")
        return self.compiler.compile_regex(regex)
