"""Tenants: named by X-Tenant or the OpenAI ``user`` field, limited per tenant in requests
in flight and tokens per minute (429 + Retry-After), priority classes to the engine."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from server_helpers import LiveServer

from runtime.errors import InvalidRequestError
from runtime.server import ServerLimits, create_app
from runtime.server.tenants import TenantLimiter, TenantLimitError, caller_of

GOOD = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_reserves_refunds_and_refills() -> None:
    clock = Clock()
    limiter = TenantLimiter(None, 600, clock)  # 10 tokens a second
    limiter.acquire("a", 500)
    with pytest.raises(TenantLimitError) as err:
        limiter.acquire("a", 200)
    assert err.value.retry_after == pytest.approx(10.0)  # 100 short at 10/s
    limiter.acquire("b", 600)  # another tenant has its own bucket
    limiter.release("a", unused_tokens=300)  # used 200 of its 500
    limiter.acquire("a", 350)
    clock.now = 60.0
    limiter.acquire("a", 600)  # a minute later: full again
    with pytest.raises(InvalidRequestError, match="at most 600 per minute"):
        limiter.acquire("c", 601)  # never fits: a 4xx, not a 429


def test_concurrency_per_tenant() -> None:
    limiter = TenantLimiter(2, None)
    limiter.acquire("a", 0)
    limiter.acquire("a", 0)
    with pytest.raises(TenantLimitError, match="2 requests in flight"):
        limiter.acquire("a", 0)
    limiter.acquire(None, 0)  # anonymous is a tenant of its own
    limiter.release("a")
    limiter.acquire("a", 0)


def test_caller_from_headers_and_user_field() -> None:
    assert caller_of({}, None).tenant is None and caller_of({}).priority == "interactive"
    assert caller_of({"x-tenant": "acme"}, "bob").tenant == "acme"  # the header wins
    assert caller_of({}, "bob").tenant == "bob"
    assert caller_of({"x-priority": "Batch"}).priority == "batch"
    with pytest.raises(InvalidRequestError, match="X-Priority"):
        caller_of({"x-priority": "urgent"})
    with pytest.raises(InvalidRequestError, match="tenant name"):
        caller_of({"x-tenant": "x" * 200})


def test_tenant_limits_over_http_are_429_with_retry_after(engine: Any) -> None:
    limits = ServerLimits(max_tokens=256, tenant_max_concurrent=1, tenant_tokens_per_minute=400)
    long = {"text": "Hi", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    with LiveServer(create_app(engine, limits=limits, model_name="m")) as live, \
            httpx.Client(base_url=live.url, timeout=30) as c:
        with c.stream("POST", "/generate", json=long, headers={"X-Tenant": "a"}) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            next(lines)
            busy = c.post("/generate", json=GOOD, headers={"X-Tenant": "a"})
            assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
            assert "tenant 'a' has 1 requests in flight" in busy.json()["error"]["message"]
            other = c.post("/generate", json=GOOD, headers={"X-Tenant": "b"})
            assert other.status_code == 200  # another tenant is not held back
            for _ in lines:  # read it to the end: all 200 tokens are used
                pass
        assert engine.wait_idle(10)
        # "a" used ~200 of its 400 tokens a minute: a request reserving 300 more must wait.
        over = c.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 250,
                                               "user": "a"})
        assert over.status_code == 429, over.text
        assert int(over.headers["Retry-After"]) >= 1
        assert "tokens per minute" in over.json()["error"]["message"]
        never = c.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 250}},
                       headers={"X-Tenant": "c", "X-Priority": "batch"})
        assert never.status_code == 200  # 251 tokens fit a fresh tenant's 400
        bad = c.post("/generate", json=GOOD, headers={"X-Priority": "now"})
        assert bad.status_code == 400 and "X-Priority" in bad.json()["error"]["message"]


def test_tenant_and_priority_reach_the_engine_request(http: Any, idle_engine: Any) -> None:
    seen: list[tuple[str | None, str]] = []
    lock = threading.Lock()

    def hook(batch: Any) -> None:
        with lock:
            seen.extend((i.request.tenant, i.request.priority) for i in batch.prefill)

    remove = idle_engine.add_step_hook(hook)
    try:
        assert http.post("/generate", json=GOOD, headers={"X-Tenant": "acme", "X-Priority": "batch"}).status_code == 200
        assert http.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 2, "user": "bob",
            "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    finally:
        remove()
    assert ("acme", "batch") in seen and ("bob", "interactive") in seen
