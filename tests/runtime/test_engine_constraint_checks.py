"""Every constrained output is checked, or the request is refused up front.

On the tiny random-weight model. The relaxed schemas force their output whatever the
model's weights: ``{"enum": ["a"], "not": {"const": "a"}}`` compiles to a grammar that
ignores ``not`` and admits only ``"a"``, which the full schema refuses.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from grammars import ChoiceConstraint, ConstraintError, to_constraint
from runtime import ConstraintCheck, Engine, SamplingParams

RELAXED_INVALID = {"type": "string", "enum": ["a"], "not": {"const": "a"}}
RELAXED_VALID = {"const": "b", "not": {"const": "a"}}
NOT_ENFORCED = "keywords not enforced: not"


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Iterator[Engine]:
    engine = Engine(model=str(tiny_llama_dir), page_size=16, num_pages=2048, num_threads=1)
    yield engine
    engine.close()


def generate(engine: Engine, constraint: object, **params: object) -> object:
    return engine.generate("Output:", SamplingParams(constraint=constraint, **params))[0]  # type: ignore[arg-type]


def test_relaxed_output_failing_the_full_schema_is_flagged(tiny: Engine) -> None:
    out = generate(tiny, RELAXED_INVALID, max_new_tokens=8)
    assert (out.text, out.finish_reason, out.error) == ('"a"', "stop", None)
    check = out.constraint_check
    assert check is not None and (check.relaxed, check.valid, check.checked) == (NOT_ENFORCED, False, True)
    assert check.error is not None and "should not be valid" in check.error


def test_relaxed_output_passing_the_full_schema_says_so(tiny: Engine) -> None:
    out = generate(tiny, RELAXED_VALID, max_new_tokens=8)
    assert out.text == '"b"'
    assert out.constraint_check == ConstraintCheck(NOT_ENFORCED, True, checked=True)


def test_exact_grammar_output_is_valid_by_construction(tiny: Engine) -> None:
    out = generate(tiny, {"type": "boolean"}, max_new_tokens=8, temperature=0)
    assert out.text in ("true", "false")
    assert out.constraint_check == ConstraintCheck(None, True, checked=False)
    assert generate(tiny, None, max_new_tokens=2).constraint_check is None


def test_output_cut_by_the_length_cap_is_not_called_valid(tiny: Engine) -> None:
    out = generate(tiny, {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
                   max_new_tokens=3, temperature=0)
    assert out.finish_reason == "length"
    assert out.constraint_check == ConstraintCheck(None, None)


def test_output_cut_by_a_stop_string_is_checked(tiny: Engine) -> None:
    out = generate(tiny, ChoiceConstraint(("yes!", "no!")), max_new_tokens=8, stop=["!"])
    assert out.finish_reason == "stop" and out.text in ("yes", "no")
    check = out.constraint_check
    assert check is not None and (check.valid, check.checked) == (False, True)


def test_metrics_count_relaxed_compilations_and_failed_outputs(tiny: Engine) -> None:
    schema = {"type": "string", "enum": ["c"], "not": {"const": "c"}}  # not compiled before
    before = tiny.metrics()
    outs = tiny.generate(["x", "y"], SamplingParams(max_new_tokens=8, constraint=schema))
    after = tiny.metrics()
    assert [o.constraint_check.valid for o in outs if o.constraint_check] == [False, False]
    assert after["constraint_relaxed_compilations"] == before["constraint_relaxed_compilations"] + 1
    assert after["constraint_outputs_checked"] == before["constraint_outputs_checked"] + 2
    assert after["constraint_outputs_invalid"] == before["constraint_outputs_invalid"] + 2


def test_strict_schema_that_would_be_relaxed_is_refused_at_submission(tiny: Engine) -> None:
    strict = to_constraint({"type": "array", "uniqueItems": True, "items": {"not": {"type": "null"}}}, strict=True)
    with pytest.raises(ConstraintError, match=r"strict JSON schema refused.*not, uniqueItems"):
        tiny.generate("x", SamplingParams(max_new_tokens=4, constraint=strict))
    assert generate(tiny, to_constraint({"type": "boolean"}, strict=True), max_new_tokens=4).text in ("true", "false")


def test_number_bounds_stop_runaway_digits_and_lift_on_request(tiny: Engine) -> None:
    def longest_digit_runs(bounds: object) -> list[int]:
        constraint = to_constraint({"type": "integer"}, json_bounds=bounds)  # type: ignore[arg-type]
        params = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=i, constraint=constraint)
                  for i in range(16)]
        outs = tiny.generate(["Output:"] * 16, params)
        return [max(len(run) for run in re.findall("[0-9]+", o.text)) for o in outs]

    from grammars import DEFAULT_JSON_BOUNDS

    assert max(longest_digit_runs(DEFAULT_JSON_BOUNDS)) <= 20
    assert max(longest_digit_runs(None)) > 20  # random weights run on: the bound is what stops them
