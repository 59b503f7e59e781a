"""``gen()``'s keywords are packed into typed option groups (frontend_dsl/gen_options.py)."""

from __future__ import annotations

import pytest

from frontend_dsl import gen
from frontend_dsl.errors import ProgramDefinitionError
from frontend_dsl.gen_options import (
    ChoiceOptions,
    GenOptions,
    LogprobOptions,
    SamplingOptions,
    StopOptions,
)
from frontend_dsl.primitives import SAMPLING_SETTINGS, Gen, Select, gen_from_options


def test_keywords_and_option_groups_build_the_same_expression() -> None:
    by_keywords = gen("x", max_tokens=8, temperature=0.5, stop="\n", top_logprobs_num=2)
    by_options = gen_from_options("x", GenOptions(
        sampling=SamplingOptions(max_tokens=8, temperature=0.5), stopping=StopOptions(stop=("\n",)),
        logprobs=LogprobOptions(top_logprobs_num=2)))
    assert by_keywords == by_options
    assert isinstance(by_options, Gen) and by_options.params.return_logprob is True  # implied by top_logprobs_num
    assert "temperature" not in by_options.inherit and "top_p" in by_options.inherit


def test_the_groups_cover_exactly_the_inheritable_settings() -> None:
    assert set(GenOptions().inheritable()) == set(SAMPLING_SETTINGS)


def test_given_names_the_settings_off_their_defaults() -> None:
    assert SamplingOptions(temperature=0.0, seed=3).given() == ["temperature", "seed"]
    assert StopOptions().given() == []


def test_a_select_refuses_settings_it_would_ignore_by_their_keyword_names() -> None:
    assert isinstance(gen_from_options("c", GenOptions(choice=ChoiceOptions(choices=("a", "b")))), Select)
    with pytest.raises(ProgramDefinitionError, match="max_tokens, stop, tool_result_prefix would do nothing"):
        gen("c", choices=["a", "b"], max_tokens=3, stop="x", tool_result_prefix="> ")
