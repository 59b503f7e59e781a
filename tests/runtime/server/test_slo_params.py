"""Per-request latency targets on the native API reach the engine's SamplingParams."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from runtime.server.api.sglang_schema import SglSamplingParams
from runtime.server.protocol import NativeSamplingParams


def test_per_request_targets_reach_the_engine(http: Any, engine: Any) -> None:
    seen: list[tuple[float | None, float | None]] = []
    remove = engine.add_step_hook(lambda batch: seen.extend(
        (r.params.ttft_slo, r.params.itl_slo) for r in [*(i.request for i in batch.prefill), *batch.decode]))
    try:
        r = http.post("/generate", json={"text": "Hi", "sampling_params": {
            "max_new_tokens": 2, "temperature": 0, "ttft_slo": 1.5, "itl_slo": 0.05}})
    finally:
        remove()
    assert r.status_code == 200, r.text
    assert (1.5, 0.05) in seen


@pytest.mark.parametrize("bad", [{"itl_slo": 0}, {"ttft_slo": -2.0}])
def test_non_positive_targets_are_refused(bad: dict[str, float], http: Any) -> None:
    with pytest.raises(ValidationError):
        NativeSamplingParams(**bad)
    with pytest.raises(ValidationError):
        SglSamplingParams(**bad)
    r = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1, **bad}})
    assert r.status_code in (400, 422), r.text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_openai_requests_carry_their_targets(path: str, body: dict[str, Any], http: Any, engine: Any) -> None:
    seen: list[tuple[float | None, float | None]] = []
    remove = engine.add_step_hook(lambda batch: seen.extend(
        (r.params.ttft_slo, r.params.itl_slo) for r in [*(i.request for i in batch.prefill), *batch.decode]))
    try:
        r = http.post(path, json={**body, "max_tokens": 2, "temperature": 0, "ttft_slo": 2.5, "itl_slo": 0.04})
    finally:
        remove()
    assert r.status_code == 200, r.text
    assert (2.5, 0.04) in seen


@pytest.mark.parametrize("bad", [{"itl_slo": 0}, {"ttft_slo": -1}, {"itl_slo": "soon"}])
def test_openai_bad_targets_are_a_4xx(bad: dict[str, Any], http: Any) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **bad})
    assert r.status_code in (400, 422), r.text
    assert ("itl_slo" if "itl_slo" in bad else "ttft_slo") in r.text
