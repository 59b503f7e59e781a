"""The load test's client (``test_load.py``), run as a process of its own:

    python load_client.py URL NUM_REQUESTS DEADLINE_S

sends ``NUM_REQUESTS`` concurrent mixed requests to the server at ``URL``, retrying each
refused one (429/503) after a pause until ``DEADLINE_S`` has passed, and prints every
request's attempts as JSON: ``[[status, outcome, seconds], ...]`` per request, outcome
"ok" for a complete answer, else the error message.

NOTE: a process of its own, not a thread of the test: 200 concurrent httpx requests keep
a Python thread busy, and in the server's process that thread would hold the GIL the
server and the engine need (measured: engine steps 5x their CPU time in wall time), so
the test would measure the client, not the server.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import httpx

CHAT = [{"role": "user", "content": "Say something."}]
RETRY_PAUSE_S = 0.25
Attempt = tuple[int, str, float]


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
    """(status, outcome) of one attempt; a transport error is status 0."""
    path, body, streamed = request_for(i)
    try:
        if not streamed:
            r = await client.post(path, json=body)
            return r.status_code, "ok" if r.status_code == 200 else r.json()["error"]["message"]
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, r.json()["error"]["message"]
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    final = [json.loads(e[6:]) for e in events[:-1]]
    finished = any(e.get("finish_reason") or any(c.get("finish_reason") for c in e.get("choices", []))
                   for e in final)
    return 200, "ok" if events[-1] == "data: [DONE]" and finished else f"incomplete stream {events[-2:]}"


async def send_with_retries(client: httpx.AsyncClient, i: int, deadline: float) -> list[Attempt]:
    """Every attempt of request ``i``; a refused one is retried after a pause until
    ``deadline`` (monotonic seconds)."""
    attempts: list[Attempt] = []
    while True:
        started = time.monotonic()
        status, outcome = await send(client, i)
        attempts.append((status, outcome, round(time.monotonic() - started, 3)))
        if status not in (429, 503) or time.monotonic() + RETRY_PAUSE_S > deadline:
            return attempts
        await asyncio.sleep(RETRY_PAUSE_S)


async def burst(url: str, num_requests: int, deadline_s: float) -> list[list[Attempt]]:
    deadline = time.monotonic() + deadline_s
    limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=num_requests)
    async with httpx.AsyncClient(base_url=url, timeout=deadline_s, limits=limits) as client:
        return list(await asyncio.gather(*(send_with_retries(client, i, deadline)
                                           for i in range(num_requests))))


if __name__ == "__main__":
    server_url, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    print(json.dumps(asyncio.run(burst(server_url, count, seconds))))
