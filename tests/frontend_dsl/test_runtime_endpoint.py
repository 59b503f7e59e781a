"""``RuntimeEndpoint``: every setting of a ``gen`` reaches the server's native API."""

from __future__ import annotations

import dataclasses

import pytest

from frontend_dsl.backend import GenParams
from frontend_dsl.errors import GenerationError
from frontend_dsl.output_constraint import make_constraint
from frontend_dsl.runtime_endpoint import wire_params
from runtime.server.api.common.wire import ConstraintSpec
from runtime.server.api.sglang.schema import NativeSamplingParams


def test_every_gen_setting_goes_on_the_wire() -> None:
    params = GenParams(max_tokens=7, stop=(".",), temperature=0.5, top_p=0.9, top_k=3, min_p=0.1,
                       seed=4, constraint=make_constraint("[0-9]+", None, None), return_logprob=True,
                       speculation=False, stop_token_ids=(5,), ignore_eos=True, top_logprobs_num=3,
                       logprob_start_len=2)
    # NOTE: a new GenParams field fails here until wire_params sends it (run_id is no
    # sampling setting: it names the run for a backend that keeps its states; a thinking
    # span's marker and budget stay home: the executor splits the text, and refuses a
    # constraint or budget after a span on a backend without ``supports_reasoning``).
    local = {"run_id", "reasoning_end", "reasoning_budget"}
    assert {f.name for f in dataclasses.fields(GenParams)} - local == {
        "max_tokens", "stop", "temperature", "top_p", "top_k", "min_p", "seed", "constraint",
        "return_logprob", "speculation", "stop_token_ids", "stop_regex", "ignore_eos", "min_tokens",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "top_logprobs_num",
        "logprob_start_len"}
    assert wire_params(params) == NativeSamplingParams(
        max_new_tokens=7, stop=["."], temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, seed=4,
        logprobs=True, speculation=False, constraint=ConstraintSpec(regex="[0-9]+"),
        stop_token_ids=[5], ignore_eos=True, top_logprobs=3, prompt_logprobs=True, logprob_start_len=2)


def test_settings_the_servers_protocol_lacks_raise_a_typed_error() -> None:
    # The penalties, min_tokens and stop_regex go on the wire only when set; a server
    # whose native API does not take them yet is refused with a GenerationError (once
    # the sampling branch adds them to NativeSamplingParams this test goes through).
    params = GenParams(max_tokens=4, frequency_penalty=0.5)
    if "frequency_penalty" in NativeSamplingParams.model_fields:
        assert wire_params(params).frequency_penalty == 0.5  # type: ignore[attr-defined]
    else:
        with pytest.raises(GenerationError, match="frequency_penalty"):
            wire_params(params)


def test_unset_sampling_settings_keep_the_servers_defaults() -> None:
    assert wire_params(GenParams(max_tokens=5)) == NativeSamplingParams(max_new_tokens=5)
