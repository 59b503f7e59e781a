"""Admission bounded by the expected wait for a first token: the estimator on a fake
clock, the gate's 429 with Retry-After, and a live server past saturation."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from server_helpers import LiveServer

from runtime.server import ServerLimits, create_app
from runtime.server.limits import AdmissionGate, Overloaded
from runtime.server.queue_wait import QueueWaitEstimator


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_pace_is_unknown_until_a_first_token_and_nobody_waiting_is_no_wait() -> None:
    est = QueueWaitEstimator(clock=Clock())
    assert est.expected_wait(0) == 0.0
    assert est.expected_wait(5) is None and est.rate(5) is None


def test_a_busy_queue_waits_waiting_plus_one_over_the_rate() -> None:
    clock = Clock()
    est = QueueWaitEstimator(clock=clock)
    est.queue_busy()
    for t in (1.0, 2.0, 3.0, 4.0):  # one first token a second while the queue stays busy
        clock.now = t
        est.first_token()
    assert est.rate(10) == pytest.approx(1.0)
    assert est.expected_wait(10) == pytest.approx(11.0)


def test_a_lightly_loaded_server_does_not_read_as_slow() -> None:
    clock = Clock()
    est = QueueWaitEstimator(clock=clock)
    for arrival in (0.0, 10.0, 20.0):  # one request every 10 s, served in 0.1 s
        clock.now = arrival
        est.queue_busy()
        clock.now = arrival + 0.1
        est.first_token()
    clock.now = 25.0
    assert est.rate(0) == pytest.approx(10.0)  # 3 first tokens in 0.3 busy seconds
    est.queue_busy()  # then 9 arrive at once
    assert est.expected_wait(9) == pytest.approx(1.0)


def test_a_stalled_server_sees_its_estimate_rise_without_events() -> None:
    clock = Clock()
    est = QueueWaitEstimator(clock=clock)
    est.queue_busy()
    clock.now = 1.0
    est.first_token()
    assert est.expected_wait(4) == pytest.approx(5.0)
    clock.now = 11.0  # ten seconds more without a first token while 4 wait
    assert est.expected_wait(4) == pytest.approx(5 * 11.0)


def test_old_first_tokens_leave_the_window() -> None:
    clock = Clock()
    est = QueueWaitEstimator(window_s=30.0, clock=clock)
    est.queue_busy()
    clock.now = 1.0
    est.first_token()
    clock.now = 40.0
    assert est.rate(0) is None and est.expected_wait(3) is None
    with pytest.raises(ValueError, match="window_s must be > 0"):
        QueueWaitEstimator(window_s=0)


def saturated_gate(bound: float | None) -> AdmissionGate:
    """A gate whose estimator saw one first token a second, with 20 requests waiting."""
    clock = Clock()
    gate = AdmissionGate(ServerLimits(max_queue_wait_s=bound), QueueWaitEstimator(clock=clock))
    gate.wait_started()
    for t in (1.0, 2.0, 3.0):
        clock.now = t
        gate.wait_started()
        gate.wait_ended(first_token=True)
    for _ in range(19):
        gate.wait_started()
    assert gate.num_waiting == 20
    return gate


def test_the_gate_refuses_past_the_bound_with_429_and_retry_after() -> None:
    gate = saturated_gate(bound=5.0)
    assert gate.expected_wait() == pytest.approx(21.0)
    with pytest.raises(Overloaded) as err:
        gate.admit()
    assert err.value.status == 429 and err.value.retry_after == 16.0
    assert "would wait about 21 s for its first token (limit 5 s)" in str(err.value)
    assert gate.num_inflight == 0  # nothing taken
    for _ in range(17):  # the queue drains under the bound: admitted again
        gate.wait_ended(first_token=False)
    assert gate.expected_wait() == pytest.approx(4.0)
    gate.admit()
    assert gate.num_inflight == 1


def test_the_gate_refuses_a_wait_past_a_share_of_the_request_s_own_deadline() -> None:
    gate = saturated_gate(bound=30.0)  # expected wait 21 s: under the server's bound
    share = gate.limits.queue_wait_deadline_share
    assert share == 0.25
    gate.admit(deadline_s=600.0)  # the server's default deadline: 150 s, the 30 s bound rules
    gate.admit()  # no deadline at all
    with pytest.raises(Overloaded) as err:  # 21 s of a 60 s deadline is past its quarter (15 s)
        gate.admit(deadline_s=60.0)
    assert err.value.status == 429 and err.value.retry_after == 6.0  # ceil(21 - 15)
    assert "would wait about 21 s for its first token (limit 0.25 of its 60 s deadline)" in str(err.value)
    assert gate.num_inflight == 2  # nothing taken by the refusal
    gate.admit(deadline_s=84.0)  # exactly a quarter: admitted
    no_bound = saturated_gate(bound=None)  # the share applies without a server bound too
    with pytest.raises(Overloaded, match="limit 0.25 of its 80 s deadline"):
        no_bound.admit(deadline_s=80.0)
    no_bound.admit(deadline_s=100.0)
    assert no_bound.num_inflight == 1


def test_the_deadline_share_is_a_setting() -> None:
    from runtime.errors import InvalidRequestError

    clock = Clock()
    gate = AdmissionGate(ServerLimits(max_queue_wait_s=None, queue_wait_deadline_share=0.5),
                         QueueWaitEstimator(clock=clock))
    gate.wait_started()
    clock.now = 1.0
    gate.wait_ended(first_token=True)
    for _ in range(9):
        gate.wait_started()
    assert gate.expected_wait() == pytest.approx(10.0)
    with pytest.raises(Overloaded, match="limit 0.5 of its 19 s deadline"):
        gate.admit(deadline_s=19.0)
    gate.admit(deadline_s=20.0)
    for share in (0.0, 1.5):
        with pytest.raises(InvalidRequestError, match="queue_wait_deadline_share must be in"):
            ServerLimits(queue_wait_deadline_share=share)


def test_no_bound_admits_whatever_the_wait() -> None:
    gate = saturated_gate(bound=None)
    gate.admit()
    assert gate.num_inflight == 1


def test_the_bound_is_validated() -> None:
    from runtime.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="max_queue_wait_s must be > 0 or None"):
        ServerLimits(max_queue_wait_s=0)


async def burst(url: str, n: int, max_tokens: int,
                timeout: float | None = None) -> list[tuple[int, float, float | None, dict[str, str], int]]:
    """``n`` streamed /generate requests at once (each with ``timeout``, if given): (status,
    seconds to the answer's headers, seconds to the first event or None, headers, events
    received)."""
    async def one(client: httpx.AsyncClient) -> tuple[int, float, float | None, dict[str, str], int]:
        body: dict[str, Any] = {"text": "one two three four", "stream": True, "sampling_params": {
            "max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}}
        if timeout is not None:
            body["timeout"] = timeout
        start = time.monotonic()
        async with client.stream("POST", "/generate", json=body) as r:
            answered = time.monotonic() - start
            first, events = None, 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    assert '"error"' not in line, line
                    first = first if first is not None else time.monotonic() - start
                    events += 1
            return r.status_code, answered, first, dict(r.headers), events

    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        for _ in range(3):  # learn the pace: three requests alone
            assert (await one(client))[0] == 200
        return list(await asyncio.gather(*(one(client) for _ in range(n))))


@pytest.mark.parametrize(("bound", "timeout"), [(0.5, None), (None, None), (None, 2.0)])
def test_past_saturation_a_prompt_429_and_every_admitted_request_completes(
        engine: Any, idle_engine: Any, bound: float | None, timeout: float | None) -> None:
    """A slowed engine (20 ms a step) and a burst of 64 streams of 24 tokens: with a bound
    (the server's, or a quarter of the requests' own 2 s timeout) the requests past it get
    429 + Retry-After at once, and every admitted one streams to its end; without one,
    everything is admitted and waits."""
    remove = engine.add_step_hook(lambda batch: time.sleep(0.02))
    try:
        app = create_app(engine, limits=ServerLimits(max_queue_wait_s=bound, max_tokens=64), model_name="m")
        with LiveServer(app) as live:
            results = asyncio.run(burst(live.url, 64, 24, timeout))
    finally:
        remove()
    refused = [r for r in results if r[0] == 429]
    admitted = [r for r in results if r[0] == 200]
    assert len(refused) + len(admitted) == len(results)  # nothing else: no 5xx, no 503
    assert all(r[2] is not None and r[4] > 0 for r in admitted)  # each streamed its tokens
    if bound is None and timeout is None:
        assert not refused
        return
    assert refused and admitted
    assert all(int(r[3]["retry-after"]) >= 1 for r in refused)
    assert max(r[1] for r in refused) < 5.0  # refused at once, not after a wait
