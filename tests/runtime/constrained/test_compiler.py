"""GrammarCompiler: caching, per-kind backends, errors and the time bound."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from grammars import Constraint, ConstraintError, RegexConstraint, load_grammar, to_constraint
from runtime.constrained import (
    DEFAULT_BACKEND_BY_KIND,
    CompiledGrammar,
    GrammarBackend,
    GrammarCompiler,
    GrammarMatcher,
)


class SlowBackend(GrammarBackend):
    """Compiles nothing until ``release`` is set: a stand-in for a hung library."""

    name = "llguidance"

    def __init__(self) -> None:
        super().__init__(vocab_size=64, eos_token_id=2)
        self.release = threading.Event()
        self.num_compiles = 0

    @classmethod
    def from_tokenizer(cls, hf_tokenizer: Any, vocab_size: int | None = None) -> GrammarBackend:
        raise NotImplementedError

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        self.num_compiles += 1
        self.release.wait(timeout=5)
        raise ConstraintError("released")


@pytest.fixture
def compiler(tokenizer: Any, get_backend: Any) -> Any:
    backends = {name: get_backend(name) for name in ("llguidance", "xgrammar")}
    compiler = GrammarCompiler(tokenizer, len(tokenizer), backends=backends)
    yield compiler
    compiler.close()


def test_compile_returns_a_grammar_whose_matchers_work(compiler: Any, tokenizer: Any) -> None:
    matcher: GrammarMatcher = compiler.compile(["yes", "no"]).new_matcher()
    assert all(matcher.accept_token(t) for t in tokenizer.encode("yes", add_special_tokens=False))
    assert matcher.is_terminated()


def test_same_constraint_is_compiled_once(compiler: Any) -> None:
    first = compiler.compile({"type": "integer"})
    assert compiler.compile({"type": "integer"}) is first
    assert compiler.compile_async(to_constraint({"type": "integer"})).result() is first
    assert compiler.compile({"type": "string"}) is not first


def test_forced_backend_is_used_for_every_kind(tokenizer: Any, get_backend: Any) -> None:
    compiler = GrammarCompiler(
        tokenizer, backend="xgrammar", backends={"xgrammar": get_backend("xgrammar")}
    )
    assert compiler.backend_name_for(load_grammar("json")) == "xgrammar"
    assert type(compiler.compile(int).grammar).__name__ == "XGrammarGrammar"
    compiler.close()


def test_default_backend_per_kind_is_recorded_for_every_kind(compiler: Any) -> None:
    assert set(DEFAULT_BACKEND_BY_KIND) == {"json_schema", "regex", "choice", "type", "grammar"}
    assert compiler.backend_name_for(to_constraint(int)) == DEFAULT_BACKEND_BY_KIND["type"]


def test_unknown_backend_name_is_refused(tokenizer: Any) -> None:
    with pytest.raises(ConstraintError, match="unknown grammar backend 'vllm'"):
        GrammarCompiler(tokenizer, backend="vllm")


def test_invalid_constraints_fail_through_the_future_and_sync(compiler: Any) -> None:
    future = compiler.compile_async({"type": "integr"})
    with pytest.raises(ConstraintError, match="invalid JSON schema"):
        future.result()
    with pytest.raises(ConstraintError, match="unknown constraint type"):
        compiler.compile(object())


def test_backend_errors_surface_as_constraint_errors(compiler: Any) -> None:
    with pytest.raises(ConstraintError, match="cannot compile regex"):
        compiler.compile(RegexConstraint(r"(a)\1"))


def test_compilation_past_the_time_bound_fails_and_is_not_cached(tokenizer: Any) -> None:
    slow = SlowBackend()
    compiler = GrammarCompiler(tokenizer, timeout_s=0.2, backends={"llguidance": slow})
    future = compiler.compile_async(RegexConstraint("a+"))
    assert not future.done()  # compile_async never blocks
    with pytest.raises(ConstraintError, match="grammar compilation timed out after 0.2 s"):
        future.result(timeout=3)
    slow.release.set()
    with pytest.raises(ConstraintError, match="released"):
        compiler.compile(RegexConstraint("a+"), timeout_s=3)  # retried, not the cached timeout
    assert slow.num_compiles == 2
    compiler.close()


def test_sync_compile_bounded_by_its_own_timeout(tokenizer: Any) -> None:
    slow = SlowBackend()
    compiler = GrammarCompiler(tokenizer, timeout_s=30, backends={"llguidance": slow})
    with pytest.raises(ConstraintError, match="timed out after 0.1 s"):
        compiler.compile(RegexConstraint("b+"), timeout_s=0.1)
    slow.release.set()
    compiler.close()


def test_relaxed_json_grammar_says_what_it_does_not_enforce(compiler: Any) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    compiled = compiler.compile(schema)
    assert compiled.approximation is not None and "uniqueItems" in compiled.approximation
    assert compiler.compile({"type": "integer"}).approximation is None


def test_relaxed_grammar_names_every_keyword_it_ignores(compiler: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}},
                                               "b": {"type": "array", "uniqueItems": True}},
              "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    before = compiler.num_relaxed
    compiled = compiler.compile(schema)
    assert compiled.approximation == "keywords not enforced: if, then, not, uniqueItems"
    compiler.compile(schema)  # a cache hit is not another compilation
    assert compiler.num_relaxed == before + 1


def test_strict_schema_that_would_be_relaxed_is_refused_naming_the_keywords(compiler: Any) -> None:
    from grammars import JsonSchemaConstraint

    schema = {"type": "array", "items": {"type": "integer", "not": {"const": 0}}, "uniqueItems": True}
    with pytest.raises(ConstraintError, match=r"strict JSON schema refused.*not, uniqueItems"):
        compiler.compile(JsonSchemaConstraint.from_schema(schema, strict=True))
    assert compiler.compile(to_constraint({"type": "integer"}, strict=True)).approximation is None
    assert compiler.compile(schema).approximation is not None  # without strict: relaxed


def test_outputs_of_a_backend_that_relaxes_silently_are_always_checked(tokenizer: Any, get_backend: Any) -> None:
    # xgrammar skips `not` without a word: the grammar's end proves nothing, so the check runs.
    compiler = GrammarCompiler(tokenizer, backend="xgrammar", backends={"xgrammar": get_backend("xgrammar")})
    compiled = compiler.compile({"type": "string", "enum": ["a"], "not": {"const": "a"}})
    check = compiled.check('"a"', "stop", grammar_end=True)
    assert (compiled.approximation, check.valid, check.checked) == (None, False, True)
    compiler.close()


def test_a_constraint_over_the_size_bound_is_refused_before_compiling(tokenizer: Any) -> None:
    slow = SlowBackend()
    compiler = GrammarCompiler(tokenizer, backend="llguidance", backends={"llguidance": slow},
                               max_source_bytes=1000)
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(100)}}
    with pytest.raises(ConstraintError, match=r"json_schema constraint is \d+ bytes; the limit is 1000"):
        compiler.compile(schema)
    with pytest.raises(ConstraintError, match="the limit is 1000"):
        compiler.compile(RegexConstraint("a" * 2000))
    assert slow.num_compiles == 0  # refused up front: no compile thread taken
    compiler.close()
