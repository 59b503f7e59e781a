"""Grammar front end: turns user constraints into typed, validated constraint objects.

Imports nothing from the rest of Arbor; ``runtime.constrained`` compiles these
objects into token masks.
"""

from grammars.constraints import (
    DEFAULT_JSON_BOUNDS,
    ChoiceConstraint,
    Constraint,
    GrammarConstraint,
    JsonBounds,
    JsonSchemaConstraint,
    RegexConstraint,
    TypeConstraint,
)
from grammars.errors import ConstraintError
from grammars.library import load_grammar, shipped_grammars
from grammars.normalize import to_constraint
from grammars.validate import OutputMismatchError, is_valid_output, parse_output

__all__ = [
    "DEFAULT_JSON_BOUNDS",
    "ChoiceConstraint",
    "Constraint",
    "ConstraintError",
    "GrammarConstraint",
    "JsonBounds",
    "JsonSchemaConstraint",
    "OutputMismatchError",
    "RegexConstraint",
    "TypeConstraint",
    "is_valid_output",
    "load_grammar",
    "parse_output",
    "shipped_grammars",
    "to_constraint",
]
