"""Adapts outlines' output types (``outlines.types``) to Arbor constraints.

outlines is imported lazily: only when the object handed in comes from it.
"""

from __future__ import annotations

import json
from typing import Any

from grammars.constraints import (
    ChoiceConstraint,
    Constraint,
    GrammarConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)
from grammars.errors import ConstraintError


def is_outlines_type(obj: Any) -> bool:
    """True for instances of outlines' output-type classes (Regex, JsonSchema, Choice...)."""
    return type(obj).__module__.startswith("outlines.")


def from_outlines(obj: Any) -> Constraint:
    """Convert an ``outlines.types`` term into the equivalent constraint.

    JsonSchema → JsonSchemaConstraint, Choice → ChoiceConstraint, CFG →
    GrammarConstraint (outlines CFGs are Lark text), Regex and every other regex
    term (sequences, alternatives, quantifiers, ``outlines.types.integer``...) →
    RegexConstraint of outlines' own ``to_regex``.
    """
    from outlines.types import dsl

    if isinstance(obj, dsl.JsonSchema):
        return JsonSchemaConstraint.from_schema(_schema_dict(obj.schema))
    if isinstance(obj, dsl.Choice):
        return ChoiceConstraint(tuple(_choice_text(item) for item in obj.items))
    if isinstance(obj, dsl.CFG):
        return GrammarConstraint(obj.definition)
    if isinstance(obj, dsl.Regex):
        return RegexConstraint(obj.pattern)
    if isinstance(obj, dsl.Term):
        return RegexConstraint(dsl.to_regex(obj))
    raise ConstraintError(f"unsupported outlines object {type(obj).__name__}")


def _schema_dict(schema_text: str) -> dict[str, Any]:
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"invalid JSON schema: not JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise ConstraintError("invalid JSON schema: expected an object")
    return schema


def _choice_text(item: Any) -> str:
    if isinstance(item, str):
        return item
    value = getattr(item, "value", item)  # enum members
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise ConstraintError(f"unsupported choice item {item!r} (strings and numbers only)")
