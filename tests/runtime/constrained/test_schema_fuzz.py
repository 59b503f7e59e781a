"""Hypothesis on the grammar front end: random JSON schemas, valid and broken alike,
either compile to a grammar whose matcher accepts something, or fail with a clear
``ConstraintError`` (a message, our type); never another exception, never a hang."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammars import ConstraintError, to_constraint
from runtime.constrained import GrammarCompiler, allocate_token_bitmask
from runtime.constrained.bitmask import unpack_bitmask

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                    st.floats(allow_nan=False, allow_infinity=False, width=32),
                    st.text(max_size=8))
TYPES = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null",
                         "nonsense", 5])
PATTERNS = st.sampled_from([r"^[a-z]+$", r"\d{3}", r"(a|b)*c", r"a(b", r"[", r"^$", r"\p{L}+",
                            r"(?=x)y", r".*", r"a{2,1}"])
FORMATS = st.sampled_from(["date", "date-time", "email", "uuid", "ipv4", "uri", "bogus"])


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional={
        "type": st.one_of(TYPES, st.lists(TYPES, max_size=3)),
        "enum": st.lists(SCALARS, max_size=4), "const": SCALARS,
        "minimum": st.integers(-100, 100), "maximum": st.integers(-100, 100),
        "exclusiveMinimum": st.integers(-5, 5), "multipleOf": st.sampled_from([0, 1, 2, 0.5, -1]),
        "minLength": st.integers(-1, 20), "maxLength": st.integers(-1, 20),
        "pattern": PATTERNS, "format": FORMATS, "$ref": st.sampled_from(["#/$defs/a", "#/nowhere", "x"]),
    })


def _node(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    names = st.text(min_size=1, max_size=6)
    return st.fixed_dictionaries({}, optional={
        "type": TYPES,
        "properties": st.dictionaries(names, children, max_size=4),
        "required": st.lists(names, max_size=3),
        "additionalProperties": st.one_of(st.booleans(), children),
        "items": st.one_of(children, st.lists(children, max_size=2)),
        "minItems": st.integers(-1, 5), "maxItems": st.integers(-1, 5),
        "anyOf": st.lists(children, max_size=3), "oneOf": st.lists(children, max_size=3),
        "allOf": st.lists(children, max_size=3), "not": children,
        "$defs": st.dictionaries(st.just("a"), children, max_size=1),
        "uniqueItems": st.booleans(),
    })


SCHEMAS = st.recursive(_leaf(), _node, max_leaves=12)
ANYTHING = st.one_of(SCHEMAS, SCALARS, st.lists(SCALARS, max_size=3))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Any:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), timeout_s=20.0)
    yield compiler
    compiler.close()


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=ANYTHING, strict=st.booleans())
def test_random_schemas_compile_or_fail_clearly(compiler: Any, schema: Any, strict: bool) -> None:
    try:
        constraint = to_constraint(schema, strict=strict) if isinstance(schema, dict) else to_constraint(schema)
        compiled = compiler.compile(constraint)
    except ConstraintError as exc:
        assert str(exc), "a ConstraintError must say why"
        return
    # A grammar that compiled can start: its first mask allows a token (or it may end).
    matcher = compiled.new_matcher()
    bitmask = allocate_token_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    allowed = int(unpack_bitmask(bitmask, compiler.vocab_size).sum())
    assert allowed > 0 or matcher.can_end(), f"compiled but allows nothing: {schema!r}"
