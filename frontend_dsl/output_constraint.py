"""Output constraints of a ``gen``: what the caller asked for and how the output is checked.

``OutputConstraint`` is the DSL's own record of ``regex=`` / ``json_schema=`` / ``grammar=``.
``to_engine_constraint`` is the single place that maps it onto what the engine accepts
(``grammars`` constraint objects), and ``parse_output`` turns the generated text into the
variable's value, checking it against the whole constraint (``jsonschema`` or pydantic
for JSON, ``re`` for regexes, ``lark`` for grammars).
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

# What an output cut by max_tokens fell short of, per kind (for the error message).
_INCOMPLETE = {"json_schema": "the JSON value was complete", "regex": "the output matched the regex",
               "grammar": "the output was a sentence of the grammar"}


@dataclass(frozen=True)
class OutputConstraint:
    """One output constraint.

    ``value`` is a regex pattern (str), a JSON schema (dict) or pydantic model class, or a
    ``grammars.GrammarConstraint`` (Lark text is validated into one), according to
    ``kind``. ``strict`` and ``json_bounds`` apply to JSON schemas (see ``gen``).
    """

    kind: ConstraintKind
    value: Any
    strict: bool = False
    json_bounds: bool = True

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (pydantic classes become their JSON schema)."""
        out = {"kind": self.kind, "value": self.json_value()}
        if self.strict:
            out["strict"] = True
        if not self.json_bounds:
            out["json_bounds"] = False
        return out

    def json_value(self) -> Any:
        if self.kind == "json_schema" and _is_model_class(self.value):
            return self.value.model_json_schema()
        if self.kind == "grammar":
            return self.value.lark_text
        return self.value


def make_constraint(
    regex: str | None, json_schema: Any, grammar: str | grammars.GrammarConstraint | None,
    strict: bool = False, json_bounds: bool = True,
) -> OutputConstraint | None:
    """Build the spec from ``gen``'s keyword arguments; at most one may be given."""
    given = [(k, v) for k, v in (("regex", regex), ("json_schema", json_schema),
                                 ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise ProgramDefinitionError(f"gen takes at most one constraint, got {[k for k, _ in given]}")
    if not given:
        if strict or not json_bounds:
            raise ProgramDefinitionError("strict= and json_bounds= apply to json_schema= only")
        return None
    kind, value = given[0]
    if kind != "json_schema" and (strict or not json_bounds):
        raise ProgramDefinitionError("strict= and json_bounds= apply to json_schema= only")
    if kind == "json_schema" and not (isinstance(value, dict) or _is_model_class(value)):
        raise ProgramDefinitionError("json_schema must be a dict or a pydantic model class")
    if kind == "regex":
        if not isinstance(value, str):
            raise ProgramDefinitionError("regex must be a string")
        try:
            re.compile(value)
        except re.error as exc:
            raise ProgramDefinitionError(f"invalid regex {value!r}: {exc}") from exc
    if kind == "grammar":
        value = _grammar(value)
    return OutputConstraint(kind, value, strict, json_bounds)  # type: ignore[arg-type]


def _grammar(value: Any) -> grammars.GrammarConstraint:
    """Lark text (validated with lark) or a grammar object (``grammars.load_grammar``)."""
    if isinstance(value, grammars.GrammarConstraint):
        return value
    if not isinstance(value, str):
        raise ProgramDefinitionError(
            "grammar must be Lark text or a grammars.GrammarConstraint (e.g. load_grammar('json'))")
    try:
        return grammars.GrammarConstraint(value)
    except grammars.ConstraintError as exc:
        raise ProgramDefinitionError(str(exc)) from None


def to_engine_constraint(spec: OutputConstraint | None) -> Any:
    """Map a spec onto the engine's ``SamplingParams.constraint`` (a ``grammars`` object)."""
    if spec is None:
        return None
    if spec.kind == "json_schema":
        bounds = grammars.DEFAULT_JSON_BOUNDS if spec.json_bounds else None
        return grammars.to_constraint(spec.value, strict=spec.strict, json_bounds=bounds)
    if spec.kind == "regex":
        return grammars.RegexConstraint(spec.value)
    return spec.value


def parse_output(text: str, spec: OutputConstraint | None, cut_at: int | None = None,
                 check: dict[str, Any] | None = None) -> Any:
    """The variable's value for generated ``text``; raises ``GenerationError`` if it fails
    the constraint (a regex that does not match in full, JSON that does not validate, text
    that lark cannot parse with the grammar).

    Args:
        cut_at: the generation's max_tokens when it ended by that cap: a failure then says
            the output was cut before it was complete.
        check: the backend's ``constraint_check`` of the output (names what a relaxed
            grammar did not enforce, for the message).
    """
    if spec is None:
        return text
    try:
        return _parse(text, spec)
    except GenerationError as exc:
        if cut_at is not None:
            raise GenerationError(f"output cut at max_tokens={cut_at} before {_INCOMPLETE[spec.kind]}: "
                                  f"{text!r:.200}") from None
        if check is not None and check.get("relaxed"):
            raise GenerationError(f"{exc} (the schema compiled to a relaxed grammar: "
                                  f"{check['relaxed']})") from exc
        raise


def _parse(text: str, spec: OutputConstraint) -> Any:
    if spec.kind == "json_schema":
        return _parse_json(text, spec.value)
    constraint = to_engine_constraint(spec)
    try:
        grammars.parse_output(constraint, text)
    except grammars.OutputMismatchError as exc:
        raise GenerationError(str(exc)) from None
    return text


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
