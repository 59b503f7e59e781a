"""A client that leaves (streaming or not) or runs out of time aborts its request, and
its KV pages are back in the pool within a second."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from server_helpers import auth, engine_metric

from runtime.output.request_output import RequestOutput
from runtime.sampling.params import SamplingParams
from runtime.scheduler.batch import ScheduledBatch
from runtime.server.serving import StreamGroup, collect, encode_prompt
from runtime.server.tenants import Caller

# Speculation off: a random-weight model loops, and prompt-lookup drafts would finish the
# "long" generation before the client gets to leave.
LONG = {"max_new_tokens": 250, "temperature": 0, "ignore_eos": True, "speculation": False}
PROMPT = "Tell me a very long story about a lighthouse keeper and the sea."


class ForwardGate:
    """A step hook that slows every step by 10 ms and can hold a request mid-generation.

    The tiny test model decodes 250 tokens in well under a second; a client starved of CPU
    for a few seconds would read its first events after the generation was over. After ``hold_at(n)``, a forward pass that would extend a request past ``n``
    output tokens waits until ``release()``: the request is certainly still running while
    the client looks and leaves, and the abort its departure causes is handled by the first
    step after ``release()``.
    """

    def __init__(self) -> None:
        self._hold_at: int | None = None
        self._released = threading.Event()

    def __call__(self, batch: ScheduledBatch) -> None:
        time.sleep(0.01)
        if self._hold_at is not None and any(
                len(r.output_ids) >= self._hold_at for r in [*batch.decode, *(v.request for v in batch.verify)]):
            assert self._released.wait(30), "the test never released the engine"

    def hold_at(self, num_tokens: int) -> None:
        self._hold_at = num_tokens
        self._released.clear()

    def release(self) -> None:
        self._hold_at = None
        self._released.set()


@pytest.fixture(autouse=True)
def gate(engine: Any) -> Iterator[ForwardGate]:
    gate = ForwardGate()
    remove = engine.add_step_hook(gate)
    yield gate
    gate.release()
    remove()


def seconds_until_idle(engine: Any, idle_pages: float, limit: float = 10.0) -> float:
    """Time until the engine holds at most ``idle_pages`` again and runs nothing (inf past
    ``limit``)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        # NOTE: <=, not ==: a request of an earlier test may still have been releasing its
        # pages when ``idle_pages`` was read; then the count settles below it (seen in CI).
        if (engine_metric(engine, "kv_pages_used") <= idle_pages
                and engine_metric(engine, "num_running") == 0):
            return time.monotonic() - start
        time.sleep(0.01)
    return float("inf")


def wait_for_pages_above(engine: Any, idle_pages: float) -> None:
    deadline = time.monotonic() + 10
    while engine_metric(engine, "kv_pages_used") <= idle_pages:
        assert time.monotonic() < deadline, "the request never took pages"
        time.sleep(0.01)


def test_dropped_stream_frees_its_pages_within_a_second(
        server: Any, idle_engine: Any, gate: ForwardGate) -> None:
    idle = engine_metric(idle_engine, "kv_pages_used")
    gate.hold_at(3)
    with httpx.Client(base_url=server.url, headers=auth(), timeout=30) as c, c.stream(
            "POST", "/generate", json={"text": PROMPT, "stream": True, "sampling_params": LONG}) as r:
        assert r.status_code == 200
        # NOTE: keep the line iterator: closing it (a ``break`` out of a for loop over it)
        # already closes the connection, and the server's abort would race the checks.
        lines = r.iter_lines()
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
        assert engine_metric(idle_engine, "kv_pages_used") > idle
        assert engine_metric(idle_engine, "num_running") == 1
    # leaving both blocks closed the connection mid-stream
    gate.release()
    assert seconds_until_idle(idle_engine, idle) < 1.0


def test_dropped_openai_stream_frees_its_pages(
        server: Any, idle_engine: Any, gate: ForwardGate) -> None:
    idle = engine_metric(idle_engine, "kv_pages_used")
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "max_tokens": 250, "temperature": 0, "ignore_eos": True}
    gate.hold_at(3)
    with httpx.Client(base_url=server.url, headers=auth(), timeout=30) as c, c.stream(
            "POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept open: see the test above
        while '"content":"' not in next(lines):
            pass
        assert engine_metric(idle_engine, "num_running") == 1
    gate.release()
    assert seconds_until_idle(idle_engine, idle) < 1.0


def test_dropped_blocking_request_frees_its_pages(
        server: Any, idle_engine: Any, gate: ForwardGate) -> None:
    idle = engine_metric(idle_engine, "kv_pages_used")
    # A raw socket, so the client leaves at a known moment (the close), not whenever an
    # HTTP client gets round to closing a timed-out connection (seen to take over a second).
    url = urlsplit(server.url)
    body = json.dumps({"text": PROMPT, "sampling_params": LONG}).encode()
    head = ["POST /generate HTTP/1.1", f"Host: {url.netloc}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in auth().items())]
    gate.hold_at(3)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        wait_for_pages_above(idle_engine, idle)
        assert engine_metric(idle_engine, "num_running") == 1  # still running as the client leaves
    gate.release()
    took = seconds_until_idle(idle_engine, idle)
    assert took < 1.0, f"idle again after {took:.2f} s"


class LeavesAsAnOutputArrives(asyncio.Queue[RequestOutput]):
    """An ``EngineStream`` queue that cancels its reader in the very loop turn an output is
    handed over: a client hanging up just as a token arrives, made certain."""

    reader: asyncio.Future[RequestOutput] | None = None

    def put_nowait(self, item: RequestOutput) -> None:
        super().put_nowait(item)
        if self.reader is not None:
            self.reader.cancel()
            self.reader = None


def test_a_client_leaving_as_a_token_arrives_still_aborts(
        server: Any, idle_engine: Any, gate: ForwardGate) -> None:
    # NOTE: asyncio.wait_for (Python 3.11) swallowed this cancellation and the request ran
    # to its end: the DP router test's "never aborted" hang-ups, 7 of 24 in a probe.
    ctx = server.server.config.app.state.ctx
    idle = engine_metric(idle_engine, "kv_pages_used")
    params = SamplingParams(**LONG)
    group = StreamGroup(ctx, "generate", [(encode_prompt(idle_engine, PROMPT), params)], 30.0, Caller())
    queue = group.streams[0].queue = LeavesAsAnOutputArrives()

    async def leave() -> int:
        async with group as [stream]:
            queue.reader = reader = asyncio.ensure_future(collect(stream))
            with pytest.raises(asyncio.CancelledError):
                await reader
            return stream.num_generated

    generated = asyncio.run(leave())
    assert generated < params.max_new_tokens
    assert seconds_until_idle(idle_engine, idle) < 1.0


def test_request_timeout_is_a_504_and_frees_pages(http: Any, idle_engine: Any) -> None:
    idle = engine_metric(idle_engine, "kv_pages_used")
    r = http.post("/generate", json={"text": PROMPT, "timeout": 0.3, "sampling_params": LONG})
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
    assert seconds_until_idle(idle_engine, idle) < 1.0


def test_program_timeout_aborts_its_generations(http: Any, idle_engine: Any) -> None:
    idle = engine_metric(idle_engine, "kv_pages_used")
    r = http.post("/programs/long_story", json={"arguments": {"seed_text": PROMPT}, "timeout": 0.3})
    assert r.status_code == 504
    assert seconds_until_idle(idle_engine, idle) < 1.0
