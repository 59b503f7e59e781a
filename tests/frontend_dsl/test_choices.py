"""select's scoring methods and temperature, against a reference computed by hand."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from frontend_dsl import ProgramDefinitionError, ProgramError, program, select
from frontend_dsl.fake_backend import FakeBackend

PROMPT = "Q: pick one. A:"
CHOICES = [" yes", " no", " maybe so"]


def table_logprob(cond: dict[int, float], uncond: dict[int, float]) -> Callable[[Sequence[int], int], float]:
    """Conditional logprobs (long context: the prompt) and unconditional ones (a context
    of the choice's own tokens only), per token id; -5 for anything else."""
    def logprob(context: Sequence[int], token: int) -> float:
        table = cond if len(context) > 3 else uncond
        return table.get(token, -5.0)

    return logprob


@pytest.fixture
def ids(fake: FakeBackend) -> dict[str, list[int]]:
    base = fake.encode(PROMPT)
    out = {}
    for c in CHOICES:
        full = fake.encode(PROMPT + c)
        assert full[: len(base)] == base  # the choices do not merge with the prompt here
        out[c] = full[len(base):]
    return out


def run_select(backend: FakeBackend, **kwargs: Any) -> Any:
    @program
    def p(s: Any) -> None:
        s += PROMPT + select("c", CHOICES, **kwargs)

    return p.run(backend)


def test_each_method_matches_its_reference(make_fake: Callable[..., FakeBackend], ids: dict[str, list[int]]) -> None:
    yes, no, maybe = ids[" yes"], ids[" no"], ids[" maybe so"]
    assert len(yes) == len(no) == 1 and len(maybe) == 2
    cond = {yes[0]: -2.0, no[0]: -1.5, maybe[0]: -1.0, maybe[1]: -3.0}
    uncond = {maybe[1]: -0.5}  # "so" is likely after "maybe" anywhere; " yes" has no context
    backend = make_fake(logprob_fn=table_logprob(cond, uncond))
    spans = {" yes": [-2.0], " no": [-1.5], " maybe so": [-1.0, -3.0]}
    reference = {
        "token_length_normalized": {c: sum(v) / len(v) for c, v in spans.items()},
        "unnormalized": {c: sum(v) for c, v in spans.items()},
        "greedy_token_selection": {c: v[0] for c, v in spans.items()},
        # first token's unconditional logprob counts 0; "so" loses 0.5 of its -3
        "unconditional_likelihood_normalized": {" yes": -2.0, " no": -1.5, " maybe so": (-1.0 + -2.5) / 2},
    }
    expected = {"token_length_normalized": " no", "unnormalized": " no",
                "greedy_token_selection": " maybe so", "unconditional_likelihood_normalized": " no"}
    for method, scores in reference.items():
        state = run_select(backend, method=method)
        assert state.get_meta("c")["scores"] == pytest.approx(scores), method
        assert state["c"] == expected[method], method
        assert state.text() == PROMPT + expected[method]


def test_aliases_and_choices_method(fake: FakeBackend) -> None:
    assert select("c", ["a"], "greedy").method == "greedy_token_selection"
    assert select("c", ["a"], choices_method="unconditional").method == "unconditional_likelihood_normalized"
    with pytest.raises(ProgramDefinitionError, match="unknown select method"):
        select("c", ["a"], "best")
    with pytest.raises(ProgramDefinitionError, match="temperature"):
        select("c", ["a"], temperature=-1)


def test_greedy_breaks_first_token_ties_on_later_tokens(make_fake: Callable[..., FakeBackend],
                                                        ids: dict[str, list[int]]) -> None:
    yes, maybe = ids[" yes"], ids[" maybe so"]
    backend = make_fake(logprob_fn=table_logprob({yes[0]: -1.0, maybe[0]: -1.0, maybe[1]: -0.1}, {}))
    # " yes" pads its 2nd position with its mean (-1.0) < -0.1: " maybe so" wins the tie
    assert run_select(backend, method="greedy")["c"] == " maybe so"


def test_user_method_gets_the_token_logprobs(make_fake: Callable[..., FakeBackend], ids: dict[str, list[int]]) -> None:
    seen: dict[str, Any] = {}

    def longest(*, choices: list[str], token_logprobs: list[list[float]],
                unconditional_token_logprobs: list[list[float]] | None) -> int:
        seen.update(choices=choices, lengths=[len(t) for t in token_logprobs], uncond=unconditional_token_logprobs)
        return max(range(len(choices)), key=lambda i: len(token_logprobs[i]))

    state = run_select(make_fake(), method=longest)
    assert state["c"] == " maybe so" and seen == {"choices": CHOICES, "lengths": [1, 1, 2], "uncond": None}
    assert state.get_meta("c")["method"] == "longest"

    def by_name(**kwargs: Any) -> str:
        return " no"

    by_name.requires_unconditional_logprobs = True  # type: ignore[attr-defined]
    state = run_select(make_fake(), method=by_name)
    assert state["c"] == " no" and "unconditional_token_logprobs" in state.get_meta("c")
    with pytest.raises(ProgramError, match="not one of the choices"):
        run_select(make_fake(), method=lambda **kw: " never")
    with pytest.raises(ProgramDefinitionError, match="callable method decides"):
        select("c", ["a"], by_name, temperature=0.5)


def test_temperature_samples_by_softmax_of_the_scores(make_fake: Callable[..., FakeBackend],
                                                      ids: dict[str, list[int]]) -> None:
    yes, no, maybe = ids[" yes"], ids[" no"], ids[" maybe so"]
    cond = {yes[0]: math.log(0.6), no[0]: math.log(0.3), maybe[0]: math.log(0.1), maybe[1]: math.log(0.1)}
    backend = make_fake(logprob_fn=table_logprob(cond, {}))
    picks = Counter(run_select(backend, temperature=1.0, seed=seed, method="unnormalized")["c"]
                    for seed in range(300))
    # softmax(sum logprob / 1) over the choices: 0.6, 0.3, 0.01 (normalised)
    total = 0.6 + 0.3 + 0.01
    assert picks[" yes"] / 300 == pytest.approx(0.6 / total, abs=0.08)
    assert picks[" no"] / 300 == pytest.approx(0.3 / total, abs=0.08)
    same = {run_select(backend, temperature=1.0, seed=7)["c"] for _ in range(3)}
    assert len(same) == 1  # a seed makes the draw repeatable
