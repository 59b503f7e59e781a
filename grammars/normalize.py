"""``to_constraint``: the one door from user-facing values to constraint objects."""

from __future__ import annotations

import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any

from grammars.constraints import (
    DEFAULT_JSON_BOUNDS,
    ChoiceConstraint,
    Constraint,
    JsonBounds,
    JsonSchemaConstraint,
    TypeConstraint,
)
from grammars.errors import ConstraintError
from grammars.library import grammar_from_file
from grammars.outlines_types import from_outlines, is_outlines_type

_BUILTIN_TYPES: dict[type, str] = {int: "int", float: "float", bool: "bool", str: "str"}


def to_constraint(
    obj: Any, *, strict: bool = False, json_bounds: JsonBounds | None = DEFAULT_JSON_BOUNDS
) -> Constraint:
    """Normalise anything Arbor accepts as a constraint into a Constraint object.

    Accepted: a Constraint (returned as is); a JSON schema dict; a pydantic model
    class; a list/tuple of strings (choice); ``typing.Literal[...]`` or a str Enum
    class (choice); the types int, float, bool, str; a ``pathlib.Path`` to a
    ``.lark`` file; an outlines output type (``outlines.types.Regex``,
    ``JsonSchema``, ``Choice``, ``CFG``, other regex terms).

    A bare string is refused as ambiguous: wrap it in RegexConstraint(...) or
    GrammarConstraint(...), or use ``load_grammar(name)``.

    ``strict`` and ``json_bounds`` set ``JsonSchemaConstraint.strict`` / ``.bounds`` of a
    JSON schema given as a dict, a pydantic model or an outlines type (other constraints
    are always exact and have no numbers to bound; a Constraint object keeps its own).

    Raises:
        ConstraintError: the value is invalid or of an unknown type.
    """
    if isinstance(obj, Constraint):
        return _complete(obj)
    if isinstance(obj, dict):
        return JsonSchemaConstraint.from_schema(obj, strict=strict, bounds=json_bounds)
    if is_outlines_type(obj):
        constraint = from_outlines(obj)
        if isinstance(constraint, JsonSchemaConstraint) and (strict, json_bounds) != (False, DEFAULT_JSON_BOUNDS):
            return dataclasses.replace(constraint, strict=strict, bounds=json_bounds)
        return constraint
    if isinstance(obj, type) and hasattr(obj, "model_json_schema"):  # pydantic model
        return JsonSchemaConstraint.from_schema(_pydantic_schema(obj), strict=strict, bounds=json_bounds)
    return _normalise(obj)


def _normalise(obj: Any) -> Constraint:
    if isinstance(obj, list | tuple):
        return ChoiceConstraint(tuple(obj))
    if isinstance(obj, Path):
        return grammar_from_file(obj)
    if isinstance(obj, str):
        raise ConstraintError(
            "a bare string is ambiguous as a constraint: use RegexConstraint(pattern), "
            "GrammarConstraint(lark_text) or load_grammar(name)"
        )
    return _from_python_type(obj)


def _complete(constraint: Constraint) -> Constraint:
    """``constraint`` if it was built through its constructor (it has a ``key``)."""
    try:
        constraint.key  # noqa: B018 - computing it is the check
    except (AttributeError, NotImplementedError) as exc:
        raise ConstraintError(
            f"incomplete {type(constraint).__name__} ({exc}); build it with its constructor"
        ) from None
    return constraint


def _from_python_type(obj: Any) -> Constraint:
    if obj in _BUILTIN_TYPES:
        return TypeConstraint(_BUILTIN_TYPES[obj])  # type: ignore[arg-type]
    if typing.get_origin(obj) is typing.Literal:
        return ChoiceConstraint(tuple(typing.get_args(obj)))
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return ChoiceConstraint(tuple(member.value for member in obj))
    raise ConstraintError(
        f"unknown constraint type {type(obj).__name__} ({obj!r:.80}); expected a JSON "
        "schema dict, pydantic model class, list of choices, int/float/bool/str, "
        "Literal[...], Enum, .lark Path, grammars constraint or outlines type"
    )


def _pydantic_schema(model: Any) -> dict[str, Any]:
    """A pydantic model class's JSON schema, closed unless it sets ``extra="allow"``."""
    schema: dict[str, Any] = model.model_json_schema()
    if getattr(model, "model_config", {}).get("extra") != "allow":
        schema = close_objects(schema)
    return schema


def close_objects(schema: Any) -> Any:
    """``additionalProperties: false`` on every object schema that lists properties and
    says nothing about extra keys.

    Pydantic models ignore (``extra="ignore"``) or forbid unknown fields; generating them
    only wastes tokens and makes the model invent keys, so a model class means exactly
    its fields (unless it sets ``extra="allow"``). Plain dict schemas are left as given.
    """
    if isinstance(schema, dict):
        out = {k: close_objects(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [close_objects(v) for v in schema]
    return schema
