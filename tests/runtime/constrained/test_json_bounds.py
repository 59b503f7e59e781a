"""Bounds on JSON number literals (``grammars.JsonBounds``) on top of the grammar's mask."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import EOS, encode

from grammars import JsonBounds, JsonSchemaConstraint
from runtime.constrained import GrammarCompiler, allocate_token_bitmask, allowed_token_ids
from runtime.constrained.json_bounds import INT, START, NumberLexer


@pytest.fixture(scope="module")
def compiler(tokenizer: Any, get_backend: Any) -> Any:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), backends={"llguidance": get_backend("llguidance")})
    yield compiler
    compiler.close()


def feed(matcher: Any, tokenizer: Any, text: str) -> int:
    """Tokens of ``text`` the matcher accepts, in order, until the first refusal."""
    for n, token in enumerate(encode(tokenizer, text)):
        if not matcher.accept_token(token):
            return n
    return len(encode(tokenizer, text))


def allowed_text(matcher: Any, tokenizer: Any) -> set[str]:
    bitmask = allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_bitmask(bitmask, 0)
    return {tokenizer.decode([t]) for t in allowed_token_ids(bitmask[0], len(tokenizer))}


def test_a_25_digit_integer_is_impossible_by_default_and_possible_unbounded(compiler: Any, tokenizer: Any) -> None:
    digits = "1234567890123456789012345"
    bounded = compiler.compile({"type": "integer"}).new_matcher()
    assert feed(bounded, tokenizer, digits) == 20  # SmolLM2 spells digits one token each
    assert not any(t.isdigit() for t in allowed_text(bounded, tokenizer))  # the mask agrees
    assert bounded.accept_token(EOS)  # and the 20-digit value can end

    unbounded = compiler.compile(JsonSchemaConstraint.from_schema({"type": "integer"}, bounds=None)).new_matcher()
    assert feed(unbounded, tokenizer, digits) == 25
    assert unbounded.accept_token(EOS)


def test_fraction_and_exponent_digits_are_bounded(compiler: Any, tokenizer: Any) -> None:
    number = compiler.compile({"type": "number"})
    assert feed(number.new_matcher(), tokenizer, "-3." + "1" * 17) == 3 + 16  # '-', '3', '.', 16 digits
    assert feed(number.new_matcher(), tokenizer, "2.5e-1234") == len(encode(tokenizer, "2.5e-123"))
    small = JsonSchemaConstraint.from_schema({"type": "number"}, bounds=JsonBounds(2, 2, 1))
    assert feed(compiler.compile(small).new_matcher(), tokenizer, "12.34e5") == len(encode(tokenizer, "12.34e5"))
    assert feed(compiler.compile(small).new_matcher(), tokenizer, "123") == 2


def test_digits_inside_strings_are_not_numbers(compiler: Any, tokenizer: Any) -> None:
    text = '{"id": "' + "9" * 30 + '", "n": 1}'
    schema = {"type": "object", "properties": {"id": {"type": "string"}, "n": {"type": "integer"}}}
    matcher = compiler.compile(schema).new_matcher()
    assert feed(matcher, tokenizer, text) == len(encode(tokenizer, text))
    assert matcher.accept_token(EOS)


def test_a_longer_const_number_still_generates(compiler: Any, tokenizer: Any) -> None:
    # Bounds narrow the grammar, never empty it: a schema that demands 22 digits gets them.
    # (10**21: exact as a double, which is how llguidance reads numbers in a schema.)
    matcher = compiler.compile({"enum": [10**21]}).new_matcher()
    text = str(10**21)
    assert feed(matcher, tokenizer, text) == 22 and matcher.accept_token(EOS)


def test_rollback_restores_the_digit_count(compiler: Any, tokenizer: Any) -> None:
    matcher = compiler.compile({"type": "integer"}).new_matcher()
    assert feed(matcher, tokenizer, "1" * 20) == 20
    matcher.rollback(2)
    assert feed(matcher, tokenizer, "222") == 2


def test_no_free_whitespace_by_default_and_the_schemas_own_layout_unbounded(compiler: Any, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "x-guidance": {"whitespace_flexible": True}}
    bounded = compiler.compile(schema).new_matcher()
    assert feed(bounded, tokenizer, "{") == 1
    assert not any(t.strip() == "" for t in allowed_text(bounded, tokenizer))
    unbounded = compiler.compile(JsonSchemaConstraint.from_schema(schema, bounds=None)).new_matcher()
    assert feed(unbounded, tokenizer, '{\n  "a": 1\n}') == len(encode(tokenizer, '{\n  "a": 1\n}'))


def test_lexer_tracks_strings_escapes_and_number_parts() -> None:
    lexer = NumberLexer(JsonBounds(3, 3, 3))
    assert lexer.advance(START, b'"\\"12345"') == (START, False)  # an escaped quote stays in the string
    assert lexer.advance(START, b"-123") == ((INT, 3), False)
    assert lexer.advance(START, b"-1234") == ((INT, 3), True)
    assert lexer.advance(START, b"[123, 4567]")[1]
    assert lexer.advance(START, b"[123, 456]") == (START, False)
