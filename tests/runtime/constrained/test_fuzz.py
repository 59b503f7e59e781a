""""Always valid" fuzz at the mask level, without a model.

For each constraint, 200 seeded random walks: at every step pick a token uniformly
among those the mask allows, except that EOS, when allowed, is taken with probability
``EOS_PROB`` (uniform sampling alone almost never picks the one EOS among thousands of
allowed tokens, so walks would all hit the cap). A walk completes when EOS is taken
or the matcher is terminated; walks that reach ``MAX_TOKENS`` do not count. Every
completed output must satisfy the constraint (``grammars.parse_output``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from grammars import Constraint, RegexConstraint, is_valid_output, load_grammar, to_constraint
from runtime.constrained import (
    CompiledGrammar,
    GrammarBackend,
    allocate_token_bitmask,
    default_backend_name,
)
from tests.runtime.constrained.conftest import EOS

NUM_SAMPLES = 200
MAX_TOKENS = 512
EOS_PROB = 0.5
MIN_COMPLETED_SHARE = 0.5

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["click", "view"]},
        "at": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "ok": {"type": "boolean"},
    },
    "required": ["kind", "at", "ok"],
    "additionalProperties": False,
}

CONSTRAINTS: dict[str, Constraint] = {
    "schema_person": to_constraint(PERSON),
    "schema_event": to_constraint(EVENT),
    "regex_phone": RegexConstraint(r"\(\d{3}\) \d{3}-\d{4}"),
    "regex_word_list": RegexConstraint(r"[a-z]{1,8}(, [a-z]{1,8}){0,3}\."),
    "choice_colors": to_constraint(["red", "green", "blue", "dark green"]),
    "choice_metachars": to_constraint(["a.b", "a|b", "(a)", 'say "hi"\n']),
    "lark_arithmetic": load_grammar("arithmetic"),
    "lark_sql_select": load_grammar("sql_select"),
    "type_float": to_constraint(float),
}


@dataclass
class WalkFigures:
    completed: int = 0
    valid: int = 0
    capped: int = 0
    invalid_examples: tuple[str, ...] = ()


def _allowed_ids(bitmask: torch.Tensor, vocab_size: int) -> tuple[np.ndarray, bool]:
    """(allowed token ids other than EOS, whether EOS is allowed) of row 0."""
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
    eos_allowed = bool(bits[EOS])
    bits[EOS] = 0
    return np.flatnonzero(bits), eos_allowed


def random_walk(
    backend: GrammarBackend, compiled: CompiledGrammar, rng: random.Random
) -> list[int] | None:
    """Token ids of one random walk ending at EOS/termination, or None at the cap."""
    matcher = compiled.new_matcher()
    bitmask = allocate_token_bitmask(1, backend.vocab_size)
    token_ids: list[int] = []
    for _ in range(MAX_TOKENS):
        if matcher.is_terminated():
            return token_ids
        assert matcher.error() is None, matcher.error()
        matcher.fill_bitmask(bitmask, 0)
        others, eos_allowed = _allowed_ids(bitmask, backend.vocab_size)
        if eos_allowed and (len(others) == 0 or rng.random() < EOS_PROB):
            assert matcher.accept_token(EOS)
            return token_ids
        token = int(others[rng.randrange(len(others))])
        assert matcher.accept_token(token), f"masked-in token {token} refused"
        token_ids.append(token)
    return None


def fuzz(backend: GrammarBackend, constraint: Constraint, tokenizer: Any, seed: int) -> WalkFigures:
    rng = random.Random(seed)
    compiled = backend.compile(constraint)
    figures = WalkFigures()
    invalid = []
    for _ in range(NUM_SAMPLES):
        token_ids = random_walk(backend, compiled, rng)
        if token_ids is None:
            figures.capped += 1
            continue
        figures.completed += 1
        text = tokenizer.decode(token_ids)
        if is_valid_output(constraint, text):
            figures.valid += 1
        else:
            invalid.append(text)
    figures.invalid_examples = tuple(invalid[:3])
    return figures


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_completed_random_walk_is_valid(
    get_backend: Any, tokenizer: Any, capsys: Any, name: str
) -> None:
    constraint = CONSTRAINTS[name]
    backend = get_backend(default_backend_name(constraint.kind))
    figures = fuzz(backend, constraint, tokenizer, seed=sum(map(ord, name)))
    with capsys.disabled():
        print(
            f"\n[fuzz {name} on {backend.name}] completed {figures.completed}/{NUM_SAMPLES}, "
            f"valid {figures.valid}/{figures.completed}, capped at {MAX_TOKENS}: {figures.capped}"
        )
    assert figures.valid == figures.completed, figures.invalid_examples
    assert figures.completed >= MIN_COMPLETED_SHARE * NUM_SAMPLES
