"""gen's stop / penalty / logprob arguments, dtype, n, and a run's sampling defaults."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from frontend_dsl import ProgramDefinitionError, ProgramError, gen, gen_int, gen_string, program
from frontend_dsl.engine_backend import to_sampling_params
from frontend_dsl.fake_backend import FakeBackend, FakeRequest


def test_stop_penalty_and_logprob_arguments_reach_the_backend_and_the_engine(fake: FakeBackend) -> None:
    @program
    def p(s: Any) -> None:
        s += "Q" + gen("x", max_tokens=6, stop_token_ids=[7, 9], ignore_eos=True, min_tokens=2,
                       frequency_penalty=0.5, presence_penalty=-0.25, repetition_penalty=1.3,
                       stop_regex=r"\d+\.", top_logprobs_num=3, logprob_start_len=1)

    p.run(fake)
    params = fake.requests[0].params
    assert (params.stop_token_ids, params.ignore_eos, params.min_tokens, params.frequency_penalty,
            params.presence_penalty, params.repetition_penalty, params.stop_regex) == (
        (7, 9), True, 2, 0.5, -0.25, 1.3, (r"\d+\.",))
    assert params.return_logprob and params.top_logprobs_num == 3 and params.logprob_start_len == 1
    engine_params = to_sampling_params(params)  # what the in-process engine receives
    assert (engine_params.stop_token_ids, engine_params.ignore_eos, engine_params.min_tokens,
            engine_params.frequency_penalty, engine_params.presence_penalty,
            engine_params.repetition_penalty, engine_params.stop_regex) == (
        (7, 9), True, 2, 0.5, -0.25, 1.3, (r"\d+\.",))
    assert (engine_params.logprobs, engine_params.top_logprobs, engine_params.prompt_logprobs,
            engine_params.logprob_start_len) == (True, 3, True, 1)


def test_unset_arguments_keep_the_engines_defaults(fake: FakeBackend) -> None:
    defaults = to_sampling_params(gen("x").params)  # type: ignore[attr-defined]
    assert (defaults.frequency_penalty, defaults.repetition_penalty, defaults.min_tokens,
            defaults.prompt_logprobs, defaults.top_logprobs, defaults.stop_regex) == (0.0, 1.0, 0, False, 0, ())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop_regex": "("}, "stop_regex"),
    ({"top_logprobs_num": 21}, "top_logprobs_num"),
    ({"logprob_start_len": -1}, "logprob_start_len"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"n": 0}, "n must be"),
    ({"dtype": list}, "dtype"),
    ({"dtype": int, "regex": "a"}, "dtype= sets its own constraint"),
    ({"token_healing": True, "json_schema": {"type": "object"}}, "token_healing"),
    ({"choices_method": "greedy"}, "choices_method= applies only with choices="),
])
def test_bad_arguments_are_refused_where_they_are_written(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ProgramDefinitionError, match=message):
        gen("x", **kwargs)


def test_n_needs_a_name() -> None:
    with pytest.raises(ProgramDefinitionError, match="n > 1 needs a variable name"):
        gen(None, n=2)


@pytest.mark.parametrize(("helper", "answer", "value", "pattern"), [
    (lambda: gen("v", dtype=int), "-42", -42, r"-?[0-9]{1,19}"),
    (lambda: gen_int("v"), "17", 17, r"-?[0-9]{1,19}"),
    (lambda: gen("v", dtype="float"), "3.25", 3.25, r"-?[0-9]{1,19}(\.[0-9]{1,16})?"),
    (lambda: gen("v", dtype=bool), "False", False, r"(True|False)"),
    (lambda: gen_string("v"), '"Paris \\"city\\""', 'Paris "city"', None),
])
def test_dtype_constrains_by_regex_and_converts(make_fake: Callable[..., FakeBackend], helper: Any,
                                                answer: str, value: Any, pattern: str | None) -> None:
    backend = make_fake(lambda r: answer)

    @program
    def p(s: Any) -> None:
        s += "A: " + helper()

    state = p.run(backend)
    assert state["v"] == value and type(state["v"]) is type(value)
    assert state.text() == "A: " + answer  # the state keeps the literal as generated
    constraint = backend.requests[0].params.constraint
    assert constraint is not None and constraint.kind == "regex"
    if pattern is not None:
        assert constraint.value == pattern


def test_dtype_output_that_is_no_literal_fails_typed(make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def p(s: Any) -> None:
        s += "A: " + gen_int("v")

    with pytest.raises(ProgramError, match="does not match|match"):
        p.run(make_fake(lambda r: "twelve"))


def test_n_is_a_fork_whose_values_are_gathered(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: f" seed{r.params.seed}", token_delay_s=0.01)

    @program
    def p(s: Any) -> None:
        s += "Q:" + gen("a", n=3, seed=5, max_tokens=4) + " end"

    state = p.run(backend)
    assert state["a"] == [" seed5", " seed6", " seed7"]
    assert state.text() == "Q: end"  # the branches' text stays in the branches
    assert backend.max_in_flight == 3
    assert [n.kind for n in state.graph.nodes] == ["text", "fork", "gen", "gen", "gen", "join", "text"]


def test_n_inside_an_assistant_message(make_fake: Callable[..., FakeBackend]) -> None:
    from frontend_dsl import assistant, user

    @program
    def p(s: Any) -> None:
        s += user("Pick a number")
        s += assistant(gen("a", n=2, max_tokens=2))

    state = p.run(make_fake(lambda r: " 4"))
    assert state["a"] == [" 4", " 4"]
    assert state.messages()[-1] == {"role": "assistant", "content": ""}


@program
def two_gens(s: Any, topic: str, style: str = "plain") -> None:
    s += f"{topic} ({style}):" + gen("a") + gen("b", temperature=0.9, max_tokens=2)


def test_run_defaults_fill_what_each_gen_leaves_unset(fake: FakeBackend) -> None:
    state = two_gens.run("cats", "terse", backend=fake, temperature=0, max_new_tokens=3, top_k=4,
                         frequency_penalty=0.1)
    a, b = (r.params for r in fake.requests)
    assert (a.temperature, a.max_tokens, a.top_k, a.frequency_penalty) == (0, 3, 4, 0.1)
    assert (b.temperature, b.max_tokens, b.top_k) == (0.9, 2, 4)  # its own settings win
    assert state.text().startswith("cats (terse):")


def test_positional_arguments_and_a_leading_backend(fake: FakeBackend) -> None:
    assert two_gens.run(fake, "dogs", max_tokens=1).text().startswith("dogs (plain):")
    with pytest.raises(ProgramDefinitionError, match="twice"):
        two_gens.run("dogs", backend=fake, topic="cats")
    with pytest.raises(ProgramDefinitionError, match="takes 2 arguments"):
        two_gens.run("a", "b", "c", backend=fake)
    with pytest.raises(ProgramDefinitionError, match="min_tokens"):
        two_gens.run("a", backend=fake, max_tokens=2, min_tokens=3)
    with pytest.raises(ProgramDefinitionError, match="not both"):
        two_gens.run("a", backend=fake, max_tokens=2, max_new_tokens=3)


def test_a_program_parameter_wins_over_a_run_setting_of_the_same_name(fake: FakeBackend) -> None:
    @program
    def p(s: Any, max_tokens: int) -> None:
        s += "x" + gen("a", max_tokens=max_tokens)

    p.run(fake, max_tokens=2)
    assert fake.requests[0].params.max_tokens == 2


def test_run_batch_takes_tuples_dicts_and_sglang_aliases(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: " " + r.prompt.split(" (")[0], token_delay_s=0.01)
    states = two_gens.run_batch([("a",), {"topic": "b"}, ("c", "loud")], backend=backend,
                                num_threads=2, progress_bar=False, max_new_tokens=1)
    assert [s["a"] for s in states] == [" a", " b", " c"]
    assert backend.max_in_flight <= 2
    firsts = [r.params for r in backend.requests if r.params.temperature is None]
    assert len(firsts) == 3 and all(p.max_tokens == 1 for p in firsts)
    with pytest.raises(ProgramDefinitionError, match="num_threads"):
        two_gens.run_batch([("a",)], backend=backend, num_threads=0)
    with pytest.raises(ProgramDefinitionError, match="unknown settings"):
        two_gens.run_batch([("a",)], backend=backend, temprature=0)


def test_logprob_details_land_in_the_meta(make_fake: Callable[..., FakeBackend]) -> None:
    @program
    def p(s: Any) -> None:
        s += "Q" + gen("x", max_tokens=2, top_logprobs_num=2)

    state = p.run(make_fake(lambda r: " a b"))
    assert state.get_meta("x")["logprobs"] == [0.0, 0.0]


def _unused(r: FakeRequest) -> str:
    return ""
