"""Per-request latency targets on the native API reach the engine's SamplingParams."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from runtime.server.native_api import to_sampling_params
from runtime.server.protocol import NativeSamplingParams


def test_per_request_targets_map_to_sampling_params() -> None:
    params = to_sampling_params(NativeSamplingParams(ttft_slo=1.5, itl_slo=0.05))
    assert (params.ttft_slo, params.itl_slo) == (1.5, 0.05)
    assert to_sampling_params(NativeSamplingParams()).itl_slo is None


@pytest.mark.parametrize("bad", [{"itl_slo": 0}, {"ttft_slo": -2.0}])
def test_non_positive_targets_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        NativeSamplingParams(**bad)
