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
from dataclasses import asdict, dataclass
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
class JsonBounds:
    """Limits on JSON that no real data needs, enforced while generating (JSON Schema has
    no words for them): digits of a number literal's integer part, fraction and exponent.

    Without them a sampled ``{"type": "number"}`` can run one digit at a time until
    ``max_new_tokens`` (seen at temperature 1 on the default model: 150 digits). The
    defaults hold every IEEE double's shortest form and every 64-bit integer.
    Insignificant whitespace needs no bound of its own: every backend generates JSON on one
    line without free whitespace (``runtime.constrained.llguidance_backend.JSON_LAYOUT``).
    """

    max_int_digits: int = 20
    max_frac_digits: int = 16
    max_exp_digits: int = 3

    def __post_init__(self) -> None:
        for name in ("max_int_digits", "max_frac_digits", "max_exp_digits"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConstraintError(f"JsonBounds.{name} must be an integer >= 1, got {value!r}")


DEFAULT_JSON_BOUNDS = JsonBounds()


@dataclass(frozen=True)
class JsonSchemaConstraint(Constraint):
    """The output is one JSON value valid under ``schema_json`` (a JSON schema, as text).

    Build it with ``JsonSchemaConstraint.from_schema(dict)``; the text is compact JSON
    in the dict's own key order. NOTE: keys are not sorted on purpose: grammar engines
    emit properties in the schema's order, so two schemas that differ only in property
    order generate differently and must not share a cache key.

    ``strict``: the grammar must enforce the whole schema. A schema whose keywords a
    backend can only approximate (``not``, ``if``/``then``, ``oneOf`` read as ``anyOf``...)
    is then refused when compiled, naming them; without ``strict`` it compiles to a relaxed
    grammar (a superset) and each finished output is checked against the full schema.
    ``bounds``: limits on number literals (``JsonBounds``); None generates numbers of any
    length (and lets a schema's own ``x-guidance`` layout apply, on llguidance).
    """

    kind: ClassVar[str] = "json_schema"
    schema_json: str
    strict: bool = False
    bounds: JsonBounds | None = DEFAULT_JSON_BOUNDS

    def __post_init__(self) -> None:
        try:
            schema = json.loads(self.schema_json)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"invalid JSON schema: not JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise ConstraintError(
                f"invalid JSON schema: expected an object, got {type(schema).__name__}"
            )
        if not isinstance(self.strict, bool):
            raise ConstraintError(f"strict must be True or False, got {self.strict!r}")
        if self.bounds is not None and not isinstance(self.bounds, JsonBounds):
            raise ConstraintError(f"bounds must be JsonBounds or None, got {self.bounds!r}")
        check_json_schema(schema)

    @classmethod
    def from_schema(
        cls, schema: dict[str, Any], *, strict: bool = False,
        bounds: JsonBounds | None = DEFAULT_JSON_BOUNDS,
    ) -> JsonSchemaConstraint:
        """Canonicalise ``schema`` (a dict) and validate it."""
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ConstraintError(f"invalid JSON schema: not serialisable ({exc})") from None
        return cls(text, strict, bounds)

    @cached_property
    def schema(self) -> dict[str, Any]:
        """The schema as a dict (parsed once)."""
        schema: dict[str, Any] = json.loads(self.schema_json)
        return schema

    def canonical_text(self) -> str:
        if not self.strict and self.bounds == DEFAULT_JSON_BOUNDS:
            return self.schema_json  # NOTE: the key of a plain schema is its text alone
        bounds = None if self.bounds is None else asdict(self.bounds)
        return json.dumps({"schema": self.schema_json, "strict": self.strict, "bounds": bounds})


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
