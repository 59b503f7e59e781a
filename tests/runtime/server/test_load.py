"""200 concurrent mixed requests on loopback: each attempt completes or gets a clear
429/503 (clients retry refused ones), nothing is lost, and the page pool is intact after."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from server_helpers import LiveServer, engine_metric

from runtime.server import ServerLimits, create_app

NUM_REQUESTS = 200
CHAT = [{"role": "user", "content": "Say something."}]


def request_for(i: int) -> tuple[str, dict[str, Any], bool]:
    """(path, body, streamed) of request ``i``: five kinds, prompts varied by ``i``."""
    text = f"Request number {i}: tell me about the number {i % 7}."
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    kinds: list[tuple[str, dict[str, Any], bool]] = [
        ("/generate", {"text": text, "sampling_params": greedy}, False),
        ("/generate", {"text": text, "sampling_params": greedy, "stream": True}, True),
        ("/v1/completions", {"model": "m", "prompt": text, "max_tokens": 4, "temperature": 0,
                             "ignore_eos": True}, False),
        ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 4, "temperature": 0,
                                  "ignore_eos": True, "stream": True}, True),
        ("/programs/qa", {"arguments": {"question": text, "max_tokens": 3}}, False),
    ]
    return kinds[i % len(kinds)]


async def send(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
    """(status, outcome): "ok" for a complete answer, else the error message."""
    path, body, streamed = request_for(i)
    if not streamed:
        r = await client.post(path, json=body)
        return r.status_code, "ok" if r.status_code == 200 else r.json()["error"]["message"]
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.json()["error"]["message"]
        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    final = [json.loads(e[6:]) for e in events[:-1]]
    finished = any(e.get("finish_reason") or any(c.get("finish_reason") for c in e.get("choices", []))
                   for e in final)
    return 200, "ok" if events[-1] == "data: [DONE]" and finished else f"incomplete stream {events[-2:]}"


async def send_with_retries(client: httpx.AsyncClient, i: int) -> list[tuple[int, str]]:
    """Every attempt's (status, outcome); refused attempts are retried after a pause."""
    attempts = [await send(client, i)]
    while attempts[-1][0] in (429, 503) and len(attempts) < 40:
        await asyncio.sleep(0.25)
        attempts.append(await send(client, i))
    return attempts


async def burst(url: str) -> list[list[tuple[int, str]]]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        return list(await asyncio.wait_for(
            asyncio.gather(*(send_with_retries(client, i) for i in range(NUM_REQUESTS))), timeout=90))


@pytest.mark.slow
def test_200_concurrent_mixed_requests(engine: Any, programs: dict[str, Any]) -> None:
    assert engine.wait_idle(30)
    idle_pages = engine_metric(engine, "kv_pages_used")
    app = create_app(engine, programs=programs, limits=ServerLimits(max_inflight=48, max_tokens=64),
                     model_name="m")
    with LiveServer(app) as live:
        results = asyncio.run(burst(live.url))
        assert httpx.get(live.url + "/health").json()["requests_inflight"] == 0
    attempts = [a for request in results for a in request]
    assert len(results) == NUM_REQUESTS
    assert {status for status, _ in attempts} <= {200, 429, 503}, attempts
    refused = [outcome for status, outcome in attempts if status != 200]
    assert refused and all("retry later" in outcome for outcome in refused)  # the bound held
    # nothing lost: every request was finally served, completely
    assert all(request[-1] == (200, "ok") for request in results), [r[-1] for r in results]
    gate = app.state.ctx.gate
    assert (gate.num_inflight, gate.num_waiting) == (0, 0)
    assert engine.wait_idle(30)
    engine.check_integrity()
    assert engine_metric(engine, "kv_pages_used") == idle_pages
