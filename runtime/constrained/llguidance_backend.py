"""Grammar backend on llguidance (Earley parser + token trie; lazy, no precompute)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from grammars import Constraint, ConstraintError, GrammarConstraint, JsonSchemaConstraint
from runtime.constrained.matcher import CompiledGrammar, GrammarBackend, GrammarMatcher
from runtime.constrained.regex_source import regex_of

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions


class LLGuidanceMatcher(GrammarMatcher):
    """Wraps one ``llguidance.LLMatcher``."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int) -> None:
        self.matcher = matcher
        self.eos_token_id = eos_token_id
        # How EOS was taken, for rollback: None (not taken), "consumed" (LLMatcher
        # counted it as a token) or "after_stop" (LLMatcher was already stopped and
        # does not count EOS as a token, so only this flag records it).
        self.eos_taken: str | None = None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self.eos_taken is not None:
            return False
        if token_id == self.eos_token_id:
            return self._accept_eos()
        # NOTE: consume_token on a disallowed token puts LLMatcher in a permanent error
        # state; validate first so a refused token leaves the state unchanged.
        if self.matcher.validate_tokens([token_id]) != 1:
            return False
        return bool(self.matcher.consume_token(token_id))

    def _accept_eos(self) -> bool:
        if not self.matcher.is_accepting():
            return False
        if self.matcher.is_stopped():
            self.eos_taken = "after_stop"
        elif self.matcher.consume_token(self.eos_token_id):
            self.eos_taken = "consumed"
        return self.eos_taken is not None

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self.eos_taken == "after_stop":
            num_tokens -= 1
        self.eos_taken = None
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {_short(self.matcher)}")

    def is_terminated(self) -> bool:
        if self.eos_taken is not None:
            return True
        return bool(self.matcher.is_stopped()) and not self.matcher.is_error()

    def can_end(self) -> bool:
        return self.eos_taken is None and bool(self.matcher.is_accepting())

    def error(self) -> str | None:
        return _short(self.matcher) if self.matcher.is_error() else None

    def forced_tokens(self) -> list[int]:
        # llguidance re-tokenizes forced bytes canonically and holds back the last token
        # when a longer token could still cover the boundary.
        return list(self.matcher.compute_ff_tokens())


class LLGuidanceGrammar(CompiledGrammar):
    """A validated llguidance grammar; matchers are deep copies of a pristine one."""

    def __init__(
        self, template: llguidance.LLMatcher, eos_token_id: int, approximation: str | None = None
    ) -> None:
        self.template = template
        self.eos_token_id = eos_token_id
        self.approximation = approximation

    def new_matcher(self) -> GrammarMatcher:
        return LLGuidanceMatcher(self.template.deep_copy(), self.eos_token_id)


# JSON is generated on one line in ``json.dumps``'s default layout ({"a": 1, "b": [2, 3]}):
# flexible whitespace lets a sampler wander through newlines and indentation forever (a
# random-weight model never closes the object) and leaves nothing for the grammar to force;
# fixed separators make keys and punctuation forced tokens that speculation gets for free.
# NOTE (llguidance 1.9): with this layout the mask can refuse a token consume_token
# accepts ('"}' closing a string and its object, JSONSchemaBench ansible-navigator.json):
# the model then spells it '"' + '}'; outputs stay valid, only tokenization differs.
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# llguidance's per-row bound on Earley items (default 2,000) is reached by an object of
# ~500 properties only once generation is inside it, after the grammar compiled: the
# request then failed mid-way. Raised to the per-step bound (step_max_items, 50,000 by
# default), which still caps a step's work; a schema too large for that fails to compile.
PARSER_LIMITS = llguidance.LLParserLimits(max_items_in_row=50_000)
# The relaxation for schemas with unimplemented features (see LLGuidanceBackend).
RELAXED_JSON: JsonCompileOptions = {"lenient": True, "coerce_one_of": True}

# llguidance errors that mean "valid schema, feature not implemented" (not "invalid").
_UNSUPPORTED_MARKERS = ("Unimplemented keys", "oneOf constraints are not supported", "Unknown format")


class LLGuidanceBackend(GrammarBackend):
    """JSON schema, regex, choice, type and Lark grammars via llguidance.

    JSON schemas that use features llguidance does not implement (``not``,
    ``uniqueItems``, ``dependencies``, ``if``/``then``, ``oneOf``, unknown formats)
    compile to a relaxed grammar (those keywords ignored, ``oneOf`` as ``anyOf``) with
    ``CompiledGrammar.approximation`` naming them all (from llguidance's warnings), unless
    ``relax_unsupported_json`` is False; the final output must then be checked
    (``grammars.parse_output``; the engine does, see ``CheckedGrammar``).
    """

    name = "llguidance"
    reports_relaxation = True

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        vocab_size: int,
        eos_token_id: int,
        relax_unsupported_json: bool = True,
    ):
        super().__init__(vocab_size, eos_token_id)
        self.tokenizer = tokenizer
        self.relax_unsupported_json = relax_unsupported_json
        self.executor = llguidance.LLExecutor()

    @classmethod
    def from_tokenizer(cls, hf_tokenizer: Any, vocab_size: int | None = None) -> LLGuidanceBackend:
        vocab_size = vocab_size or len(hf_tokenizer)
        tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        return cls(tokenizer, vocab_size, int(hf_tokenizer.eos_token_id))

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        template = self._matcher(_grammar_text(constraint))
        if not template.is_error():
            return _admits_something(LLGuidanceGrammar(template, self.eos_token_id), constraint)
        error = _short(template)
        if self.relax_unsupported_json and isinstance(constraint, JsonSchemaConstraint):
            relaxed = self._relaxed_json(constraint, error)
            if relaxed is not None:
                return _admits_something(relaxed, constraint)
        raise ConstraintError(f"llguidance cannot compile {constraint.kind}: {error}")

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)

    def _relaxed_json(self, constraint: JsonSchemaConstraint, error: str) -> CompiledGrammar | None:
        """The schema with unsupported keywords ignored and oneOf read as anyOf, or None.

        Only for "unsupported feature" errors; the grammar then admits a superset of the
        schema's instances and says so in ``approximation``.
        """
        if not any(marker in error for marker in _UNSUPPORTED_MARKERS):
            return None
        template = self._matcher(_json_grammar(constraint, RELAXED_JSON))
        if template.is_error():
            return None
        warnings = template.get_grammar_warnings() or [error]
        return LLGuidanceGrammar(template, self.eos_token_id, approximation=describe_relaxation(warnings))

    def fill_bitmasks(
        self, entries: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor
    ) -> None:
        pairs = [(m.matcher, row) for m, row in entries if isinstance(m, LLGuidanceMatcher)]
        if len(pairs) != len(entries):
            super().fill_bitmasks(entries, bitmask)
            return
        llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)


def _admits_something(grammar: CompiledGrammar, constraint: Constraint) -> CompiledGrammar:
    """``grammar``, unless it allows no first token and no empty output: such a constraint
    (a schema whose references only lead back to themselves, ``{"enum": []}``...) has no
    instance, and a request under it could only fail after admission."""
    assert isinstance(grammar, LLGuidanceGrammar)
    probe = grammar.template.deep_copy()
    mask = probe.compute_bitmask()
    if probe.is_error():
        raise ConstraintError(f"llguidance cannot compile {constraint.kind}: {_short(probe)}")
    if not probe.is_accepting() and not any(mask):
        raise ConstraintError(f"the {constraint.kind} constraint admits no output at all")
    return grammar


def _grammar_text(constraint: Constraint) -> str:
    if isinstance(constraint, JsonSchemaConstraint):
        return _json_grammar(constraint, {})
    if isinstance(constraint, GrammarConstraint):
        return str(llguidance.LLMatcher.grammar_from_lark(constraint.lark_text))
    regex = regex_of(constraint)
    if regex is None:
        raise ConstraintError(f"llguidance backend does not support {constraint.kind}")
    return str(llguidance.LLMatcher.grammar_from_regex(regex))


def _json_grammar(constraint: JsonSchemaConstraint, extra: JsonCompileOptions) -> str:
    """The schema's grammar in ``JSON_LAYOUT``. NOTE: llguidance applies defaults, then the
    schema's own ``x-guidance``, then overrides: with bounds (the default) the layout wins;
    a schema without bounds may choose its own layout (free whitespace included)."""
    if constraint.bounds is None:
        layout = {"defaults": JSON_LAYOUT, "overrides": extra}
    else:
        layout = {"overrides": {**JSON_LAYOUT, **extra}}
    return str(llguidance.LLMatcher.grammar_from_json_schema(constraint.schema_json, **layout))


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*)\]")


def describe_relaxation(warnings: list[str]) -> str:
    """One line naming what a relaxed grammar does not enforce, from llguidance's warnings
    (``Unimplemented keys: ["not"]``, ``oneOf not fully supported...``, ``Unknown format: x``)."""
    names: list[str] = []
    for warning in warnings:
        if (keys := _UNIMPLEMENTED.search(warning)) is not None:
            names += [k.strip().strip('"') for k in keys.group(1).split(",")]
        elif warning.startswith("oneOf"):
            names.append("oneOf (read as anyOf)")
        elif warning.startswith("Unknown format: "):
            names.append(f"format {warning.removeprefix('Unknown format: ').strip()!r}")
        else:
            names.append(warning)
    return "keywords not enforced: " + ", ".join(dict.fromkeys(names))


def _short(matcher: llguidance.LLMatcher) -> str:
    """The first line of an llguidance error (the rest is a state dump)."""
    return matcher.get_error().strip().split("\n<state>")[0].strip()
