"""Output constraints of a ``gen``: what the caller asked for and how the output is checked.

``OutputConstraint`` is the DSL's own record of ``regex=`` / ``json_schema=`` / ``grammar=``.
``to_engine_constraint`` is the single place that maps it onto what the engine accepts
(``grammars`` constraint objects when that package provides them, else plain data), and
``parse_output`` turns the generated text into the variable's value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import pydantic

import grammars
from frontend_dsl.errors import GenerationError, ProgramDefinitionError

ConstraintKind = Literal["regex", "json_schema", "grammar"]


@dataclass(frozen=True)
class OutputConstraint:
    """One output constraint.

    ``value`` is a regex pattern (str), a JSON schema (dict) or pydantic model class,
    or a Lark grammar (str), according to ``kind``.
    """

    kind: ConstraintKind
    value: Any

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (pydantic classes become their JSON schema)."""
        return {"kind": self.kind, "value": self.json_value()}

    def json_value(self) -> Any:
        if self.kind == "json_schema" and _is_model_class(self.value):
            return self.value.model_json_schema()
        return self.value


def make_constraint(
    regex: str | None, json_schema: Any, grammar: str | None
) -> OutputConstraint | None:
    """Build the spec from ``gen``'s keyword arguments; at most one may be given."""
    given = [(k, v) for k, v in (("regex", regex), ("json_schema", json_schema),
                                 ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise ProgramDefinitionError(f"gen takes at most one constraint, got {[k for k, _ in given]}")
    if not given:
        return None
    kind, value = given[0]
    if kind == "json_schema" and not (isinstance(value, dict) or _is_model_class(value)):
        raise ProgramDefinitionError("json_schema must be a dict or a pydantic model class")
    if kind in ("regex", "grammar") and not isinstance(value, str):
        raise ProgramDefinitionError(f"{kind} must be a string")
    if kind == "regex":
        try:
            re.compile(value)
        except re.error as exc:
            raise ProgramDefinitionError(f"invalid regex {value!r}: {exc}") from exc
    return OutputConstraint(kind, value)  # type: ignore[arg-type]


def to_engine_constraint(spec: OutputConstraint | None) -> Any:
    """Map a spec onto the engine's ``SamplingParams.constraint``.

    Regex and grammar become ``grammars.RegexConstraint`` / ``GrammarConstraint``; a JSON
    schema (dict or pydantic class) is passed as is, since ``grammars.to_constraint``
    accepts both.
    """
    if spec is None:
        return None
    if spec.kind == "json_schema":
        return spec.value
    if spec.kind == "regex":
        return grammars.RegexConstraint(spec.value)
    return grammars.GrammarConstraint(spec.value)


def parse_output(text: str, spec: OutputConstraint | None) -> Any:
    """The variable's value for generated ``text``; raises ``GenerationError`` if it fails
    the constraint (a regex that does not match in full, JSON that does not validate)."""
    if spec is None or spec.kind == "grammar":
        return text
    if spec.kind == "regex":
        if re.fullmatch(spec.value, text) is None:
            raise GenerationError(f"output {text!r} does not match regex {spec.value!r}")
        return text
    return _parse_json(text, spec.value)


def _parse_json(text: str, schema: Any) -> Any:
    if _is_model_class(schema):
        try:
            return schema.model_validate_json(text)
        except pydantic.ValidationError as exc:
            raise GenerationError(f"output does not validate against {schema.__name__}: {exc}") from exc
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        raise GenerationError(f"output {text!r} does not validate against the schema: {exc}") from exc
    return value


def _is_model_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, pydantic.BaseModel)
