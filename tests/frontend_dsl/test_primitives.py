"""gen and select against the fake backend: values, constraints, scoring."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pydantic
import pytest

import grammars
from frontend_dsl import GenerationError, ProgramDefinitionError, ProgramError, gen, program, select
from frontend_dsl.fake_backend import FakeBackend, FakeRequest, default_logprob
from frontend_dsl.output_constraint import OutputConstraint


class City(pydantic.BaseModel):
    name: str
    population: int


def test_gen_returns_before_the_text_exists(make_fake: Callable[..., FakeBackend]) -> None:
    slow = make_fake(token_delay_s=0.05)
    seen: dict[str, float] = {}

    @program
    def p(s: Any) -> None:
        start = time.perf_counter()
        s += "Say:" + gen("x", max_tokens=8)
        seen["submit_s"] = time.perf_counter() - start
        seen["value"] = s["x"]
        seen["read_s"] = time.perf_counter() - start

    p.run(slow)
    assert seen["submit_s"] < 0.2 < seen["read_s"]  # 8 tokens * 50 ms only on read
    assert seen["value"] == " ok" * 8


def test_gen_params_reach_the_backend(fake: FakeBackend) -> None:
    @program
    def p(s: Any) -> None:
        s += "Q" + gen("x", max_tokens=5, stop=["\n"], temperature=0.5, top_p=0.9, top_k=7,
                       min_p=0.1, seed=3, return_logprob=True)

    state = p.run(fake)
    params = fake.requests[0].params
    assert (params.max_tokens, params.stop, params.temperature, params.top_p, params.top_k,
            params.min_p, params.seed) == (5, ("\n",), 0.5, 0.9, 7, 0.1, 3)
    assert state.get_meta("x")["logprobs"] == [0.0] * 5


def test_stop_string_is_not_in_the_state(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: " Paris.\nQ: next")

    @program
    def p(s: Any) -> None:
        s += "A:" + gen("a", stop="\n") + "|"

    state = p.run(backend)
    assert state["a"] == " Paris."
    assert state.text() == "A: Paris.|"
    assert backend.decode(state.token_ids()) == state.text()


def test_json_schema_pydantic_gives_a_validated_object(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: '{"name": "Paris", "population": 2100000}')

    @program
    def p(s: Any) -> None:
        s += "City: " + gen("city", json_schema=City)

    state = p.run(backend)
    assert state["city"] == City(name="Paris", population=2100000)
    constraint = backend.requests[0].params.constraint
    assert constraint is not None and constraint.value is City


def test_json_schema_dict_gives_a_dict(make_fake: Callable[..., FakeBackend]) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    backend = make_fake(lambda r: '{"n": 4}')

    @program
    def p(s: Any) -> None:
        s += gen("v", json_schema=schema)

    assert p.run(backend)["v"] == {"n": 4}


def test_invalid_json_surfaces_with_the_partial_state(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: '{"name": "Paris"}')

    @program
    def p(s: Any) -> None:
        s += "ok" + gen("first", max_tokens=2, regex=r".*")
        s += gen("city", json_schema=City)
        s += gen("after", max_tokens=2)

    with pytest.raises(ProgramError) as info:
        p.run(backend)
    assert isinstance(info.value.__cause__, GenerationError)
    partial = info.value.state
    first = backend.decode(backend.encode('{"name": "Paris"}')[:2])
    assert partial.variables() == {"first": first}
    assert partial.text() == "ok" + first + '{"name": "Paris"}'  # failing output kept, nothing after


def test_regex_must_match_in_full(make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def p(s: Any) -> None:
        s += gen("n", regex=r"[0-9]+")

    assert p.run(make_fake(lambda r: "42"))["n"] == "42"
    with pytest.raises(ProgramError, match="does not match regex"):
        p.run(make_fake(lambda r: "forty-two"))


ARITHMETIC = 'start: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]+/\n'


@pytest.mark.parametrize("grammar", [ARITHMETIC, grammars.load_grammar("arithmetic")], ids=["lark-text", "shipped"])
def test_grammar_output_is_checked_with_lark(make_fake: Callable[..., FakeBackend], grammar: Any) -> None:
    @program
    def p(s: Any) -> None:
        s += gen("expr", grammar=grammar)

    assert p.run(make_fake(lambda r: "1+2+30"))["expr"] == "1+2+30"
    with pytest.raises(ProgramError, match="does not match grammar") as info:
        p.run(make_fake(lambda r: "1+"))
    assert isinstance(info.value.__cause__, GenerationError)


def test_grammar_text_is_validated_when_the_program_is_written() -> None:
    with pytest.raises(ProgramDefinitionError, match="invalid grammar.*line 1 column 13"):
        gen("x", grammar='start: "a" (')
    with pytest.raises(ProgramDefinitionError, match="Lark text or a grammars.GrammarConstraint"):
        gen("x", grammar=42)  # type: ignore[arg-type]


def test_json_cut_at_max_tokens_says_so(make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def p(s: Any) -> None:
        s += gen("obj", json_schema={"type": "object"}, max_tokens=4)

    with pytest.raises(ProgramError, match=r"cut at max_tokens=4 before the JSON value was complete"):
        p.run(make_fake(lambda r: '{"name": "a very long value"}'))


def test_strict_and_json_bounds_belong_to_json_schema() -> None:
    assert gen("x", json_schema={"type": "integer"}, strict=True, json_bounds=False).params.constraint \
        == OutputConstraint("json_schema", {"type": "integer"}, strict=True, json_bounds=False)
    with pytest.raises(ProgramDefinitionError, match="apply to json_schema= only"):
        gen("x", regex="a", strict=True)
    with pytest.raises(ProgramDefinitionError, match="apply to json_schema= only"):
        gen("x", json_bounds=False)


def test_bad_primitive_arguments_fail_early() -> None:
    with pytest.raises(ProgramDefinitionError):
        gen("x", regex="a", json_schema={})
    with pytest.raises(ProgramDefinitionError):
        gen("x", regex="(")
    with pytest.raises(ProgramDefinitionError):
        select("x", [])
    with pytest.raises(ProgramDefinitionError):
        select("x", ["a"], method="best")  # type: ignore[arg-type]


@pytest.mark.parametrize("setting", [
    {"max_tokens": 4}, {"stop": "."}, {"top_p": 0.9}, {"top_k": 5},
    {"min_p": 0.1}, {"return_logprob": True}, {"speculation": False},
    {"tool_result_prefix": "\nResult: "}, {"n": 2}, {"min_tokens": 1},
    {"frequency_penalty": 0.5}, {"stop_regex": "x"}, {"ignore_eos": True},
    {"token_healing": True},
])
def test_gen_choices_refuses_the_sampling_arguments_it_would_ignore(setting: dict[str, Any]) -> None:
    [name] = setting
    with pytest.raises(ProgramDefinitionError, match=f"choices= makes this a select.*: {name} would do nothing"):
        gen("c", choices=["red", "green"], **setting)
    assert gen("c", choices=["red", "green"]) == select("c", ["red", "green"])


def test_gen_choices_passes_temperature_seed_and_method_to_the_select() -> None:
    # temperature and seed sample the choice (SGLang's gen(choices=..., temperature=...))
    assert gen("c", choices=["a", "b"], temperature=0.5, seed=3, choices_method="greedy") == \
        select("c", ["a", "b"], "greedy_token_selection", temperature=0.5, seed=3)


def test_tool_result_prefix_needs_tools() -> None:
    with pytest.raises(ProgramDefinitionError, match="tool_result_prefix= applies only with tools="):
        gen("x", tool_result_prefix="\nResult: ")


def _expected_scores(backend: FakeBackend, prefix: str, choices: list[str], normalized: bool) -> list[float]:
    """Score each choice independently on the natural tokenization of prefix + choice,
    every choice over the same span: from the first position where any of them departs
    from the prefix's own ids (the trailing space of the prefix merges with the choice)."""
    ids = backend.encode(prefix)
    fulls = [backend.encode(prefix + c) for c in choices]
    start = min(next((i for i, (a, b) in enumerate(zip(ids, f, strict=False)) if a != b), len(ids)) for f in fulls)
    assert start == len(ids) - 1  # this prefix does exercise the boundary
    out = []
    for full in fulls:
        lps = [default_logprob(full[:i], full[i]) for i in range(start, len(full))]
        out.append(sum(lps) / len(lps) if normalized else sum(lps))
    return out


@pytest.mark.parametrize("method", ["normalized", "unnormalized"])
def test_select_picks_the_best_scored_choice(fake: FakeBackend, method: str) -> None:
    choices = ["Paris", "London", "a city in Europe"]

    @program
    def p(s: Any) -> None:
        s += "The capital of France is " + select("city", choices, method=method)  # type: ignore[arg-type]

    state = p.run(fake)
    expected = _expected_scores(fake, "The capital of France is ", choices, method == "normalized")
    best = choices[expected.index(max(expected))]
    assert state["city"] == best
    assert state.get_meta("city")["scores"] == pytest.approx(dict(zip(choices, expected, strict=True)))
    assert state.text() == "The capital of France is " + best


def test_normalization_changes_the_winner(make_fake: Callable[..., FakeBackend]) -> None:
    # Every token costs -1, except " yes" costs -1.5: normalized prefers the long
    # choice (mean -1), the sum prefers the short one (-1.5 vs -4).
    backend = make_fake(logprob_fn=lambda ctx, tok: -1.5 if tok == backend.encode(" yes")[0] else -1.0)
    long_choice = " no, not at all"

    @program
    def p(s: Any, method: str) -> None:
        s += "Answer:" + select("a", [" yes", long_choice], method=method)  # type: ignore[arg-type]

    assert p.run(backend, method="normalized")["a"] == long_choice
    assert p.run(backend, method="unnormalized")["a"] == " yes"


def test_select_scores_across_a_token_boundary(make_fake: Callable[..., FakeBackend]) -> None:
    # The state ends with " Hel"; the choice "lo" merges into one token " Hello", so both
    # choices are scored from the position of " Hel" on, and the state keeps " Hello".
    backend = make_fake(logprob_fn=lambda ctx, tok: 0.0 if tok == hello else -5.0)
    hello = backend.encode("Say Hello")[-1]
    assert backend.encode("Say Hel")[:-1] + [hello] == backend.encode("Say Hello")

    @program
    def p(s: Any) -> None:
        s += "Say Hel" + select("w", ["p", "lo"])

    state = p.run(backend)
    assert state["w"] == "lo"
    assert state.token_ids()[-1] == hello
    assert state.get_meta("w")["token_logprobs"]["lo"] == [0.0]


def test_gen_choices_is_a_select(fake: FakeBackend) -> None:
    @program
    def p(s: Any) -> None:
        s += "Pick: " + gen("c", choices=["red", "green"])

    state = p.run(fake)
    assert state["c"] in ("red", "green")
    assert "scores" in state.get_meta("c")
    assert [n.kind for n in state.graph.nodes] == ["text", "select"]
    assert fake.requests == []  # scored, never generated


def test_unnamed_gen_only_adds_text(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: json.dumps(r.prompt))

    @program
    def p(s: Any) -> None:
        s += "a" + gen(max_tokens=3)

    state = p.run(backend)
    assert state.variables() == {}
    assert state.text() == 'a"a"'


def test_unknown_variable_is_a_key_error(fake: FakeBackend) -> None:
    @program
    def p(s: Any) -> None:
        s += gen("x", max_tokens=1)
        _ = s["y"]

    with pytest.raises(ProgramError) as info:
        p.run(fake)
    assert isinstance(info.value.__cause__, KeyError)


def test_requests_carry_state_token_ids(make_fake: Callable[..., FakeBackend]) -> None:
    seen: list[FakeRequest] = []

    def respond(r: FakeRequest) -> str:
        seen.append(r)
        return " x"

    backend = make_fake(respond)

    @program
    def p(s: Any) -> None:
        s += "one" + gen("a", max_tokens=1) + " two" + gen("b", max_tokens=1)

    p.run(backend)
    first, second = seen
    assert second.input_ids[: len(first.input_ids)] == first.input_ids
    assert backend.decode(second.input_ids) == "one x two"
