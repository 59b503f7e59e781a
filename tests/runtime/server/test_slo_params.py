"""Per-request latency targets on the native API reach the engine's SamplingParams."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from runtime.server.api.sglang.schema import NativeSamplingParams, SglSamplingParams


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


@pytest.fixture(scope="module")
def tenant_http(engine: Any, programs: dict[str, Any]) -> Any:
    import httpx
    from server_helpers import API_KEY, LiveServer, auth

    from runtime.server import ServerLimits, create_app

    limits = ServerLimits(max_tokens=64, request_timeout_s=30.0,
                          tenant_slo=(("fast-co", 0.5, 0.02), ("batch-co", 30.0, None)))
    app = create_app(engine, programs=programs, api_key=API_KEY, limits=limits, model_name="m")
    with LiveServer(app) as live, httpx.Client(base_url=live.url, headers=auth(), timeout=30) as client:
        yield client


@pytest.mark.parametrize("tenant, own, expected", [
    ("fast-co", {}, (0.5, 0.02)),  # the tenant's targets
    ("fast-co", {"itl_slo": 0.04}, (0.5, 0.04)),  # the request's own wins, field by field
    ("batch-co", {}, (30.0, None)),  # 'none': the engine's target
    ("someone", {}, (None, None)),  # a tenant without targets
])
def test_tenant_targets_apply_unless_the_request_sets_its_own(
        tenant: str, own: dict[str, float], expected: tuple[float | None, float | None], tenant_http: Any,
        engine: Any) -> None:
    seen: list[tuple[float | None, float | None]] = []
    remove = engine.add_step_hook(lambda batch: seen.extend(
        (r.params.ttft_slo, r.params.itl_slo) for r in [*(i.request for i in batch.prefill), *batch.decode]))
    try:
        r = tenant_http.post("/v1/completions", headers={"X-Tenant": tenant},
                             json={"prompt": "Hi", "max_tokens": 2, "temperature": 0, **own})
        native = tenant_http.post("/generate", headers={"X-Tenant": tenant}, json={
            "text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0, **own}})
    finally:
        remove()
    assert r.status_code == 200 and native.status_code == 200, (r.text, native.text)
    assert set(seen) == {expected}


def test_tenant_targets_from_the_command_line_and_bad_ones_refused() -> None:
    from runtime.cli import build_parser
    from runtime.errors import InvalidRequestError
    from runtime.server import ServerLimits
    from runtime.server.launch import limits_from_args

    args = build_parser().parse_args(["serve", "--tenant-slo", "batch=30,none", "--tenant-slo", "a=b=1,0.05"])
    assert limits_from_args(args).tenant_slo == (("batch", 30.0, None), ("a=b", 1.0, 0.05))
    for bad in ("batch=0,1", "batch=1", "=1,1", "batch=soon,1"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--tenant-slo", bad])
    with pytest.raises(InvalidRequestError, match="tenant_slo"):
        ServerLimits(tenant_slo=(("x", -1.0, None),))
