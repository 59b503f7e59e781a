"""Checks a finished output against its constraint and builds the Python value."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

import jsonschema
import lark
from jsonschema.validators import validator_for
from lark.exceptions import LarkError

from grammars.constraints import (
    ChoiceConstraint,
    Constraint,
    GrammarConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    TypeConstraint,
)
from grammars.errors import ConstraintError


class OutputMismatchError(ConstraintError):
    """A finished output does not satisfy its constraint."""


def parse_output(constraint: Constraint, text: str) -> Any:
    """The value of ``text`` under ``constraint``, or OutputMismatchError.

    Returns the parsed JSON value (json_schema), the text itself (regex, choice,
    grammar), or the int/float/bool/str literal's value (type).
    """
    if isinstance(constraint, JsonSchemaConstraint):
        return _parse_json(constraint, text)
    if isinstance(constraint, RegexConstraint):
        _require(re.fullmatch(constraint.pattern, text, re.ASCII) is not None, constraint, text)
        return text
    if isinstance(constraint, ChoiceConstraint):
        _require(text in constraint.choices, constraint, text)
        return text
    if isinstance(constraint, GrammarConstraint):
        _parse_lark(constraint, text)
        return text
    if isinstance(constraint, TypeConstraint):
        return _parse_type(constraint, text)
    raise ConstraintError(f"unknown constraint {type(constraint).__name__}")


def is_valid_output(constraint: Constraint, text: str) -> bool:
    """True when ``text`` satisfies ``constraint`` (see parse_output)."""
    try:
        parse_output(constraint, text)
    except OutputMismatchError:
        return False
    return True


def _require(ok: bool, constraint: Constraint, text: str, why: str = "") -> None:
    if not ok:
        reason = f": {why}" if why else ""
        raise OutputMismatchError(f"output {text!r:.200} does not match {constraint.kind}{reason}")


def _parse_json(constraint: JsonSchemaConstraint, text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OutputMismatchError(f"output is not JSON: {exc}") from None
    error = jsonschema.exceptions.best_match(_validator(constraint.schema_json).iter_errors(value))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        _require(False, constraint, text, error.message + (f" (at {where})" if where else ""))
    return value


@lru_cache(maxsize=64)
def _validator(schema_json: str) -> Any:
    """The jsonschema validator of a schema (built once: large schemas take milliseconds)."""
    schema = json.loads(schema_json)
    return validator_for(schema, default=jsonschema.Draft202012Validator)(schema)


def _parse_lark(constraint: GrammarConstraint, text: str) -> None:
    try:
        _lark_parser(constraint.lark_text).parse(text)
    except LarkError as exc:
        _require(False, constraint, text, str(exc).strip().splitlines()[0])


@lru_cache(maxsize=64)
def _lark_parser(lark_text: str) -> lark.Lark:
    return lark.Lark(lark_text, start="start")


def _parse_type(constraint: TypeConstraint, text: str) -> Any:
    _require(re.fullmatch(constraint.regex, text) is not None, constraint, text)
    if constraint.type_name == "bool":
        return text == "True"
    value = json.loads(text)
    return float(value) if constraint.type_name == "float" else value
