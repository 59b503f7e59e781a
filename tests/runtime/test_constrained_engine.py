"""Constrained decoding through the engine: every finished output parses and validates.

"Always valid": 200 generations per constraint kind at temperature 1.0, on the tiny
random-weight model (the most adversarial sampler there is) and on the default model.
Outputs that reach ``max_new_tokens`` mid-grammar end with finish reason "length" and
are excluded (they are partial by definition); the tests check those are rare.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field

from grammars import (
    ChoiceConstraint,
    ConstraintError,
    GrammarConstraint,
    RegexConstraint,
    is_valid_output,
    load_grammar,
    to_constraint,
)
from runtime import Engine, SamplingParams


class Item(BaseModel):
    name: Annotated[str, Field(max_length=24)]  # bounded, so random weights finish too
    quantity: int
    in_stock: bool


CASES: dict[str, Any] = {
    "json_schema": Item,
    "regex": RegexConstraint(r"(0|[1-9][0-9]{0,3})-[a-z]{2,5}"),
    "choice": ChoiceConstraint(["red", "green", "blue", "light blue"]),
    "lark": load_grammar("arithmetic"),
}
N = 200
TINY_LARK = GrammarConstraint(
    'start: sum\n?sum: NUMBER | sum "+" NUMBER | sum "*" NUMBER\nNUMBER: /[0-9]{1,3}/\n'
)


def run_many(engine: Engine, prompt: str, constraint: Any, max_new_tokens: int) -> list[Any]:
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=i,
                             constraint=constraint) for i in range(N)]
    return engine.generate([prompt] * N, params)


def assert_all_valid(outs: list[Any], constraint: Any, max_length_share: float) -> None:
    normal = to_constraint(constraint)
    finished = [o for o in outs if o.finish_reason == "stop"]
    invalid = [o.text for o in finished if not is_valid_output(normal, o.text)]
    assert not invalid, f"{len(invalid)} invalid outputs, e.g. {invalid[:3]}"
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert len(finished) >= (1 - max_length_share) * len(outs), (
        f"only {len(finished)}/{len(outs)} finished"
    )


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Engine:
    engine = Engine(model=str(tiny_llama_dir), page_size=16, num_pages=4096, max_running_requests=256)
    yield engine
    engine.close()


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in ("json_schema", "lark")
                                  else k for k in sorted(CASES)])
def test_always_valid_tiny_model(tiny: Engine, kind: str) -> None:
    # Random weights wander, so some generations end at "length"; every finished output
    # must validate. (The shipped arithmetic grammar ignores spaces, and random weights
    # favour endless whitespace tokens: the tiny model gets a Lark grammar without them.)
    constraint = TINY_LARK if kind == "lark" else CASES[kind]
    outs = run_many(tiny, "Output:", constraint, max_new_tokens=64)
    assert_all_valid(outs, constraint, max_length_share=0.5)
    tiny.wait_idle()
    tiny.check_integrity()


PROMPTS = {
    "json_schema": "Describe one item in a shop as JSON with name, quantity and in_stock.",
    "regex": "Give a number, a dash and a short lowercase word.",
    "choice": "Name a color.",
    "lark": "Write an arithmetic expression.",
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CASES))
def test_always_valid_default_model(default_engine: Engine, kind: str) -> None:
    prompt = default_engine.apply_chat_template([{"role": "user", "content": PROMPTS[kind]}])
    outs = run_many(default_engine, prompt, CASES[kind], max_new_tokens=48)
    # NOTE: arithmetic expressions run long at temperature 1: over 1,200 seeded runs, 76-80%
    # finished within 48 tokens (batches of 200 seeds: 144-169), so 25% sat on the mean.
    assert_all_valid(outs, CASES[kind], max_length_share=0.35 if kind == "lark" else 0.25)
    default_engine.wait_idle()
    default_engine.check_integrity()


def test_pydantic_output_parses_into_the_model(default_engine: Engine) -> None:
    prompt = default_engine.apply_chat_template([{"role": "user", "content": PROMPTS["json_schema"]}])
    out = default_engine.generate(prompt, SamplingParams(max_new_tokens=64, temperature=0.0, constraint=Item))[0]
    assert out.finish_reason == "stop"
    item = Item.model_validate_json(out.text)
    assert isinstance(item.quantity, int)


def test_length_mid_grammar_returns_partial_text(tiny: Engine) -> None:
    out = tiny.generate("x", SamplingParams(max_new_tokens=3, temperature=1.0, seed=0, constraint=Item))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{")


@pytest.mark.parametrize(
    "bad",
    [{"type": "objekt"}, RegexConstraint.__new__(RegexConstraint), "not a constraint"],
)
def test_invalid_constraints_fail_on_submission(tiny: Engine, bad: Any) -> None:
    with pytest.raises(ConstraintError):
        tiny.generate("x", SamplingParams(max_new_tokens=4, constraint=bad))
    out = tiny.generate("x", SamplingParams(max_new_tokens=2, temperature=0))[0]
    assert len(out.token_ids) == 2  # still serving


def test_bad_regex_and_grammar_errors_are_typed(tiny: Engine) -> None:
    with pytest.raises(ConstraintError, match="regex"):
        tiny.generate("x", SamplingParams(constraint=RegexConstraint("[a-")))
    with pytest.raises(ConstraintError, match="line"):
        tiny.generate("x", SamplingParams(constraint=GrammarConstraint('start: "a" (\n')))
