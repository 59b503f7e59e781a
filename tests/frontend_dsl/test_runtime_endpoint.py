"""``RuntimeEndpoint``: every setting of a ``gen`` reaches the server's native API."""

from __future__ import annotations

import dataclasses

from frontend_dsl.backend import GenParams
from frontend_dsl.output_constraint import make_constraint
from frontend_dsl.runtime_endpoint import wire_params
from runtime.server.protocol import ConstraintSpec, NativeSamplingParams


def test_every_gen_setting_goes_on_the_wire() -> None:
    params = GenParams(max_tokens=7, stop=(".",), temperature=0.5, top_p=0.9, top_k=3, min_p=0.1,
                       seed=4, constraint=make_constraint("[0-9]+", None, None), return_logprob=True,
                       speculation=False)
    # NOTE: a new GenParams field fails here until wire_params sends it.
    assert {f.name for f in dataclasses.fields(GenParams)} == {
        "max_tokens", "stop", "temperature", "top_p", "top_k", "min_p", "seed", "constraint",
        "return_logprob", "speculation"}
    assert wire_params(params) == NativeSamplingParams(
        max_new_tokens=7, stop=["."], temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, seed=4,
        logprobs=True, speculation=False, constraint=ConstraintSpec(regex="[0-9]+"))


def test_unset_sampling_settings_keep_the_servers_defaults() -> None:
    assert wire_params(GenParams(max_tokens=5)) == NativeSamplingParams(max_new_tokens=5)
