"""``CheckedGrammar``: what ``GrammarCompiler`` hands the engine.

A backend's compiled grammar plus the constraint it was compiled from, so that every
matcher gets the constraint's JSON number bounds (``json_bounds.py``) and every finished
output can be measured against the whole constraint (``check``): a relaxed grammar admits
a superset of the schema, and a stop string can cut an output short of its grammar's end.
"""

from __future__ import annotations

from dataclasses import dataclass

from grammars import Constraint, OutputMismatchError, parse_output
from runtime.constrained.json_bounds import BoundedMatcher, BoundsTable
from runtime.constrained.matcher import CompiledGrammar, GrammarMatcher
from runtime.output.request_output import ConstraintCheck, FinishReason


class CheckedGrammar(CompiledGrammar):
    """``grammar`` (a backend's) compiled from ``constraint``, with bounds and a check.

    Args:
        bounds: the number bounds table for JSON constraints with bounds, else None.
        always_check: check every finished output, even where the grammar reached its end
            (the backend may relax a schema without saying so).
    """

    def __init__(self, grammar: CompiledGrammar, constraint: Constraint, bounds: BoundsTable | None,
                 always_check: bool = False) -> None:
        self.grammar = grammar
        self.constraint = constraint
        self.bounds = bounds
        self.always_check = always_check
        self.approximation = grammar.approximation

    def new_matcher(self) -> GrammarMatcher:
        matcher = self.grammar.new_matcher()
        return matcher if self.bounds is None else BoundedMatcher(matcher, self.bounds)

    def check(self, text: str, reason: FinishReason, grammar_end: bool) -> ConstraintCheck:
        """The final ``text`` of a request that finished by ``reason`` ("stop" or "length").

        Args:
            grammar_end: the output ended where its grammar did (EOS or the grammar's last
                token), with no stop string or stop id in between.

        Returns:
            Valid by construction for an exact grammar that reached its end (from a backend
            that reports relaxations); otherwise the
            result of ``grammars.parse_output`` (jsonschema, ``re``, lark); an output cut by
            max_new_tokens is not checked (``valid`` None).
        """
        if reason == "length":
            return ConstraintCheck(self.approximation, None)
        if grammar_end and self.approximation is None and not self.always_check:
            return ConstraintCheck(None, True)
        try:
            parse_output(self.constraint, text)
        except OutputMismatchError as exc:
            return ConstraintCheck(self.approximation, False, checked=True, error=str(exc))
        return ConstraintCheck(self.approximation, True, checked=True)


@dataclass
class CheckStats:
    """Counters over finished outputs (written on the engine thread only)."""

    num_checked: int = 0  # outputs parsed and checked against their whole constraint
    num_invalid: int = 0  # outputs that failed it

    def count(self, check: ConstraintCheck) -> None:
        self.num_checked += check.checked
        self.num_invalid += check.valid is False
