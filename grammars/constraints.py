"""Typed, frozen constraint objects: what a generated output must look like.

Each constraint validates itself at construction (raising ConstraintError) and has a
stable ``key`` (same constraint, same key, in every process) used to cache compiled
grammars. Backends turn a constraint into a token-level grammar; ``grammars.validate``
checks a finished output against it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Literal

from grammars.errors import ConstraintError
from grammars.lark_check import check_lark
from grammars.schema_check import check_json_schema


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class Constraint:
    """Base class of every constraint. ``kind`` names the family, for backend routing."""

    kind: ClassVar[str] = "abstract"

    @property
    def key(self) -> str:
        """Stable cache key: ``"<kind>:<sha256 of the canonical text>"``."""
        return f"{self.kind}:{_digest(self.canonical_text())}"

    def canonical_text(self) -> str:
        """The constraint's source in one canonical string (hashed into ``key``)."""
        raise NotImplementedError


@dataclass(frozen=True)
class JsonSchemaConstraint(Constraint):
    """The output is one JSON value valid under ``schema_json`` (a JSON schema, as text).

    Build it with ``JsonSchemaConstraint.from_schema(dict)``; the text is compact JSON
    in the dict's own key order. NOTE: keys are not sorted on purpose: grammar engines
    emit properties in the schema's order, so two schemas that differ only in property
    order generate differently and must not share a cache key.
    """

    kind: ClassVar[str] = "json_schema"
    schema_json: str

    def __post_init__(self) -> None:
        try:
            schema = json.loads(self.schema_json)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"invalid JSON schema: not JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise ConstraintError(
                f"invalid JSON schema: expected an object, got {type(schema).__name__}"
            )
        check_json_schema(schema)

    @classmethod
    def from_schema(cls, schema: dict[str, Any]) -> JsonSchemaConstraint:
        """Canonicalise ``schema`` (a dict) and validate it."""
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ConstraintError(f"invalid JSON schema: not serialisable ({exc})") from None
        return cls(text)

    @cached_property
    def schema(self) -> dict[str, Any]:
        """The schema as a dict (parsed once)."""
        schema: dict[str, Any] = json.loads(self.schema_json)
        return schema

    def canonical_text(self) -> str:
        return self.schema_json


@dataclass(frozen=True)
class RegexConstraint(Constraint):
    """The whole output matches ``pattern`` (full match, not search).

    Python ``re`` syntax with ASCII shorthands: ``\\d``, ``\\w``, ``\\s`` mean
    ``[0-9]``, ``[0-9A-Za-z_]`` and ASCII whitespace (``re.ASCII``, as in JSON Schema
    patterns), on every backend. Checked with Python's ``re``; backends may reject features they cannot turn into
    an automaton (lookaround, backreferences) when compiling.
    """

    kind: ClassVar[str] = "regex"
    pattern: str

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise ConstraintError(f"regex must be a string, got {type(self.pattern).__name__}")
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ConstraintError(f"invalid regex {self.pattern!r}: {exc}") from None

    def canonical_text(self) -> str:
        return self.pattern


@dataclass(frozen=True)
class ChoiceConstraint(Constraint):
    """The output is exactly one of ``choices`` (non-empty, distinct strings)."""

    kind: ClassVar[str] = "choice"
    choices: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if not self.choices:
            raise ConstraintError("choice list is empty")
        bad = [c for c in self.choices if not isinstance(c, str)]
        if bad:
            raise ConstraintError(f"choices must be strings, got {bad[0]!r}")
        if len(set(self.choices)) != len(self.choices):
            raise ConstraintError(f"choices must be distinct: {list(self.choices)!r}")

    def canonical_text(self) -> str:
        return json.dumps(self.choices)


@dataclass(frozen=True)
class GrammarConstraint(Constraint):
    """The output is a sentence of ``lark_text``, a Lark grammar with a ``start`` rule.

    Validated with ``lark`` at construction: a syntax error names its line and column.
    """

    kind: ClassVar[str] = "grammar"
    lark_text: str
    name: str | None = None  # shipped grammar name (e.g. "json"), for messages only

    def __post_init__(self) -> None:
        check_lark(self.lark_text, source=self.name or "<grammar>")

    def canonical_text(self) -> str:
        return self.lark_text


BuiltinTypeName = Literal["int", "float", "bool", "str"]

# Same conventions as SGLang's and outlines' typed generation: Python literals for
# bool, JSON syntax for numbers and strings (so the value is `json.loads` of the text).
_TYPE_REGEX: dict[str, str] = {
    "int": r"-?(0|[1-9][0-9]*)",
    "float": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    "bool": r"(True|False)",
    "str": r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
}


@dataclass(frozen=True)
class TypeConstraint(Constraint):
    """The output is a literal of a built-in Python type: int, float, bool or str.

    int/float are JSON numbers, bool is ``True``/``False``, str is a JSON string
    literal (quoted). Backends compile it as the regex ``regex``.
    """

    kind: ClassVar[str] = "type"
    type_name: BuiltinTypeName

    def __post_init__(self) -> None:
        if self.type_name not in _TYPE_REGEX:
            raise ConstraintError(
                f"unknown built-in type {self.type_name!r}; expected one of {sorted(_TYPE_REGEX)}"
            )

    @property
    def regex(self) -> str:
        """The regex every output of this type fully matches."""
        return _TYPE_REGEX[self.type_name]

    def canonical_text(self) -> str:
        return self.type_name
