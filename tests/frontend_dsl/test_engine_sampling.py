"""min_tokens, stop_regex and the three penalties from ``gen`` to the real engine.

The DSL's output equals the engine's own for the same settings, and each setting changes
the output the way it should.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from frontend_dsl import gen, program

PROMPT = "The numbers are one two three one two three one two"


@pytest.fixture
def engine(tiny_engine: Any) -> Any:
    return tiny_engine


def _direct(engine: Any, **settings: Any) -> Any:
    from runtime import SamplingParams

    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    return engine.generate(input_ids=ids, sampling_params=SamplingParams(temperature=0, **settings))[0]


def _dsl(backend: Any, **settings: Any) -> Any:
    @program
    def p(s: Any) -> None:
        s += PROMPT + gen("x", temperature=0, **settings)

    return p.run(backend)


def test_penalties_over_runtime_endpoint_match_the_engine(engine: Any, endpoint: Any) -> None:
    settings = {"max_tokens": 10, "ignore_eos": True, "frequency_penalty": 1.0, "repetition_penalty": 1.3,
                "min_tokens": 2, "stop_regex": "zzz"}
    remote = _dsl(endpoint, **settings)
    local = _dsl(engine, **settings)
    assert remote["x"] == local["x"] and remote.token_ids() == local.token_ids()


@pytest.mark.parametrize("settings", [
    {"max_tokens": 12, "frequency_penalty": 1.5},
    {"max_tokens": 12, "presence_penalty": 1.5},
    {"max_tokens": 12, "repetition_penalty": 1.8},
])
def test_penalties_match_the_engine_and_curb_repeats(engine: Any, settings: dict[str, Any]) -> None:
    max_tokens = settings.pop("max_tokens")
    state = _dsl(engine, max_tokens=max_tokens, ignore_eos=True, **settings)
    direct = _direct(engine, max_new_tokens=max_tokens, ignore_eos=True, **settings)
    assert state["x"] == direct.text
    plain = _direct(engine, max_new_tokens=max_tokens, ignore_eos=True)
    ids = state.get_meta("x")["output_ids"]
    if len(set(plain.token_ids)) < len(plain.token_ids):  # the plain greedy output repeats
        assert len(set(ids)) > len(set(plain.token_ids)) or ids != list(plain.token_ids)


def test_min_tokens_holds_off_a_stop_id(engine: Any) -> None:
    first = _direct(engine, max_new_tokens=1).token_ids[0]
    stopped = _dsl(engine, max_tokens=6, stop_token_ids=[first])
    assert stopped["x"] == ""  # stops at once without min_tokens
    held = _dsl(engine, max_tokens=6, stop_token_ids=[first], min_tokens=3)
    assert held.get_meta("x")["num_output_tokens"] >= 3
    assert held["x"] == _direct(engine, max_new_tokens=6, stop_token_ids=[first], min_tokens=3).text


def test_stop_regex_cuts_the_match(engine: Any) -> None:
    plain = _direct(engine, max_new_tokens=16, ignore_eos=True).text
    assert len(plain) > 3
    pattern = re.escape(plain[2:4])  # a match the greedy output certainly reaches
    state = _dsl(engine, max_tokens=16, ignore_eos=True, stop_regex=pattern)
    assert state["x"] == plain[: plain.index(plain[2:4])]
    assert state.get_meta("x")["finish_reason"] == "stop"
