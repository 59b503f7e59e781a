"""``gen(..., reasoning=True)``: the thinking span goes to its own variable, the gen's
value is the answer after it, and on the engine a JSON schema binds only the answer (the
tiny random model thinks in noise until the budget closes the span)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from frontend_dsl import ProgramDefinitionError, ProgramError, gen, program, tool
from frontend_dsl.fake_backend import FakeBackend

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


def test_the_thinking_gets_its_own_variable(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: "<think>\nTwo and two.\n</think>\n\nFour.")

    @program
    def p(s: Any) -> None:
        s += "Q: 2+2? A: " + gen("a", reasoning=True) + gen("b", reasoning="notes", max_tokens=20)
        s += "|" + s["a_reasoning"]  # a reference to the thinking, appended when it exists

    state = p.run(backend)
    assert (state["a"], state["a_reasoning"]) == ("Four.", "Two and two.")
    assert state["notes"] == "Two and two." and state["b"] == "Four."
    assert state.text().count("</think>") == 2  # the state keeps what the model wrote
    assert state.text().endswith("Four.|Two and two.")
    assert backend.requests[0].params.reasoning_end == "</think>"


def test_an_unclosed_span_says_so(make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def p(s: Any) -> None:
        s += gen("a", reasoning=True)

    with pytest.raises(ProgramError, match="thinking span has no end"):
        p.run(make_fake(lambda r: "<think> still going"))


def test_a_constraint_after_thinking_needs_the_engine(make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def p(s: Any) -> None:
        s += gen("a", json_schema=SCHEMA, reasoning=True)

    with pytest.raises(ProgramError, match="in-process engine"):
        p.run(make_fake(lambda r: '<think>x</think>{"n": 1}'))


def test_on_the_engine_the_schema_binds_only_the_answer(tiny_engine: Any) -> None:
    @program
    def p(s: Any) -> None:
        s += "Count: " + gen("a", json_schema=SCHEMA, reasoning=True, reasoning_budget=5, max_tokens=60,
                              temperature=0)

    state = p.run(tiny_engine)
    jsonschema.validate(state["a"], SCHEMA)
    assert state["a_reasoning"] and "</think>" in state.text()
    prompt_ids = tiny_engine.tokenizer.encode("Count: ", add_special_tokens=False)
    from runtime import SamplingParams

    free = tiny_engine.generate(input_ids=prompt_ids, sampling_params=SamplingParams(max_new_tokens=5, temperature=0))
    assert state.text().startswith("Count: " + free[0].text)  # the thinking was the model's own


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"reasoning": True, "name": None}, "give a name"),
    ({"reasoning_budget": 4}, "only with reasoning"),
    ({"reasoning": True, "reasoning_budget": -1}, "reasoning_budget"),
    ({"reasoning": True, "choices": ["a", "b"]}, "choices"),
    ({"reasoning": True, "n": 2}, "reasoning="),
    ({"reasoning": 3}, "variable name"),
])
def test_wrong_reasoning_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    kwargs = {"name": "x", **kwargs}
    with pytest.raises(ProgramDefinitionError, match=message):
        gen(**kwargs)


def test_reasoning_with_tools_is_refused() -> None:
    @tool
    def add(a: int, b: int) -> int:
        return a + b

    with pytest.raises(ProgramDefinitionError, match="tools="):
        gen("x", tools=[add], reasoning=True)
