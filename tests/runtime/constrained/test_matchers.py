"""Every backend × every constraint kind: masks, acceptance, EOS rule, rollback."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from grammars import Constraint, ConstraintError, RegexConstraint, load_grammar, to_constraint
from runtime.constrained import GrammarMatcher, allocate_token_bitmask, allowed_token_ids
from tests.runtime.constrained.conftest import BACKEND_NAMES, EOS, encode

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

# (case id, constraint, a valid output, backends that cannot compile it)
CASES: list[tuple[str, Constraint, str, set[str]]] = [
    ("json_schema", to_constraint(PERSON), '{"name": "Ada", "age": 36}', set()),
    ("regex", RegexConstraint(r"[a-z]{2,4}-[0-9]{3}"), "abc-123", set()),
    ("choice", to_constraint(["red", "green", "blue"]), "green", set()),
    ("choice_metachars", to_constraint(["a.b", "x|y", 'q"\\', "(p)\n"]), "(p)\n", set()),
    ("int", to_constraint(int), "-42", set()),
    ("float", to_constraint(float), "2.5", {"outlines"}),  # outlines-core 0.2.14 bug, below
    ("bool", to_constraint(bool), "True", set()),
    ("str", to_constraint(str), '"hi \\"you\\""', set()),
    ("grammar", load_grammar("arithmetic"), "1+2*(3-4)", {"outlines"}),
]
PARAMS = [
    pytest.param(backend, constraint, text, id=f"{backend}-{case}")
    for case, constraint, text, unsupported in CASES
    for backend in BACKEND_NAMES
    if backend not in unsupported
]


def _allowed(matcher: GrammarMatcher, vocab_size: int) -> list[int]:
    bitmask = allocate_token_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    return allowed_token_ids(bitmask[0], vocab_size)


@pytest.mark.parametrize(("backend", "constraint", "text"), PARAMS)
def test_canonical_tokens_are_allowed_and_eos_only_where_the_grammar_accepts(
    get_backend: Any, tokenizer: Any, backend: str, constraint: Constraint, text: str
) -> None:
    be = get_backend(backend)
    matcher = be.compile(constraint).new_matcher()
    for token in encode(tokenizer, text):
        allowed = set(_allowed(matcher, be.vocab_size))
        assert token in allowed
        assert (EOS in allowed) == matcher.can_end()
        assert matcher.accept_token(token)
    assert EOS in _allowed(matcher, be.vocab_size)
    assert matcher.can_end()
    assert matcher.accept_token(EOS)
    assert matcher.is_terminated()


@pytest.mark.parametrize(("backend", "constraint", "text"), PARAMS)
def test_refused_token_leaves_the_state_unchanged(
    get_backend: Any, tokenizer: Any, backend: str, constraint: Constraint, text: str
) -> None:
    matcher = get_backend(backend).compile(constraint).new_matcher()
    assert not matcher.accept_token(EOS)  # nothing generated yet: no grammar here accepts ""
    assert not matcher.accept_token(encode(tokenizer, "Zebra")[0])
    assert all(matcher.accept_token(t) for t in encode(tokenizer, text))
    assert matcher.can_end()


@pytest.mark.parametrize(("backend", "constraint", "text"), PARAMS)
def test_rollback_restores_the_earlier_mask(
    get_backend: Any, tokenizer: Any, backend: str, constraint: Constraint, text: str
) -> None:
    be = get_backend(backend)
    matcher = be.compile(constraint).new_matcher()
    tokens = encode(tokenizer, text) + [EOS]
    keep = len(tokens) // 2
    masks = []
    for token in tokens:
        masks.append(_allowed(matcher, be.vocab_size))
        assert matcher.accept_token(token)
    matcher.rollback(len(tokens) - keep)
    assert _allowed(matcher, be.vocab_size) == masks[keep]
    assert all(matcher.accept_token(t) for t in tokens[keep:])
    assert matcher.is_terminated()


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_terminated_when_only_eos_is_left(get_backend: Any, tokenizer: Any, backend: str) -> None:
    be = get_backend(backend)
    choice = be.compile(to_constraint(["red", "green"])).new_matcher()
    assert all(choice.accept_token(t) for t in encode(tokenizer, "green"))
    assert choice.is_terminated() and choice.can_end()
    assert _allowed(choice, be.vocab_size) == [EOS]
    number = be.compile(to_constraint(int)).new_matcher()
    assert all(number.accept_token(t) for t in encode(tokenizer, "42"))
    assert number.can_end() and not number.is_terminated()  # more digits may follow


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_batched_fill_equals_row_by_row(get_backend: Any, tokenizer: Any, backend: str) -> None:
    be = get_backend(backend)
    matchers = [be.compile(to_constraint(c)).new_matcher() for c in (int, ["yes", "no"], PERSON)]
    matchers[0].accept_token(encode(tokenizer, "7")[0])
    together = allocate_token_bitmask(3, be.vocab_size)
    be.fill_bitmasks([(m, row) for row, m in enumerate(matchers)], together)
    for row, matcher in enumerate(matchers):
        alone = allocate_token_bitmask(1, be.vocab_size)
        matcher.fill_bitmask(alone, 0)
        assert torch.equal(together[row], alone[0])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("pattern", [r"(a)\1", r"a(?=b)"], ids=["backreference", "lookahead"])
def test_regex_features_no_automaton_has_are_refused(
    get_backend: Any, backend: str, pattern: str
) -> None:
    with pytest.raises(ConstraintError, match=f"{backend} cannot compile regex"):
        get_backend(backend).compile(RegexConstraint(pattern))


def test_outlines_refuses_context_free_grammars(get_backend: Any) -> None:
    with pytest.raises(ConstraintError, match="outlines backend does not support grammar"):
        get_backend("outlines").compile(load_grammar("json"))


def test_outlines_core_drops_single_dot_token_after_a_final_state(get_backend: Any) -> None:
    """Known outlines-core 0.2.14 defect (why "float" is skipped for outlines above):
    in ``3(\\.5)?`` after "3" it allows ".5" but not the canonical "." token."""
    matcher = get_backend("outlines").compile(RegexConstraint(r"3(\.5)?")).new_matcher()
    assert matcher.accept_token(35)  # "3"
    assert not matcher.accept_token(30)  # "." — refused, though "3.5" matches


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_logits_wider_than_the_tokenizer_never_allow_padding_ids(
    tokenizer: Any, backend: str
) -> None:
    from runtime.constrained import create_backend

    be = create_backend(backend, tokenizer, vocab_size=49152 + 128)
    matcher = be.compile(to_constraint(str)).new_matcher()
    bitmask = allocate_token_bitmask(1, be.vocab_size)
    assert bitmask.shape[1] == (49152 + 128) // 32
    for token in encode(tokenizer, '"ok"'):
        matcher.fill_bitmask(bitmask, 0)
        assert max(allowed_token_ids(bitmask[0], be.vocab_size)) < 49152
        assert matcher.accept_token(token)
    assert matcher.accept_token(EOS)


def test_llguidance_forced_tokens_are_the_canonical_prefix(
    get_backend: Any, tokenizer: Any
) -> None:
    matcher = get_backend("llguidance").compile(to_constraint(["constrained decoding"])).new_matcher()
    canonical = encode(tokenizer, "constrained decoding")
    forced = matcher.forced_tokens()
    assert forced and forced == canonical[: len(forced)]
    assert all(matcher.accept_token(t) for t in canonical)
    assert matcher.forced_tokens() == []


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_regex_shorthands_are_ascii_on_every_backend(
    get_backend: Any, tokenizer: Any, backend: str
) -> None:
    """\\d is [0-9], as Python's re.ASCII and JSON Schema read it: no Arabic-Indic digits."""
    be = get_backend(backend)
    matcher = be.compile(RegexConstraint(r"\d{2}\s\w+")).new_matcher()
    arabic_three = encode(tokenizer, "٣")
    assert not matcher.accept_token(arabic_three[0])
    assert all(matcher.accept_token(t) for t in encode(tokenizer, "42 ok_1"))
    assert matcher.can_end()


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_json_is_written_on_one_line_with_json_dumps_separators(
    get_backend: Any, tokenizer: Any, backend: str
) -> None:
    compiled = get_backend(backend).compile(to_constraint(PERSON))

    def accepts(text: str) -> bool:
        matcher = compiled.new_matcher()
        return all(matcher.accept_token(t) for t in encode(tokenizer, text)) and matcher.can_end()

    assert accepts('{"name": "Ada", "age": 36}')  # json.dumps layout
    assert not accepts('{"name":"Ada","age":36}')  # compact
    assert not accepts('{\n  "name": "Ada",\n  "age": 36\n}')  # indented
