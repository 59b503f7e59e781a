"""The router's HTTP front over fake workers: relaying, affinity, streams, client
disconnects, workers that die or hang, health, metrics and the API key."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fake_worker import FakeWorker
from server_helpers import LiveServer, free_port, samples

from runtime.router.app import create_router_app
from runtime.router.config import HealthConfig, PolicyConfig

FAST_HEALTH = HealthConfig(interval_s=0.1, timeout_s=0.5, failures_to_remove=2)


class Cluster:
    def __init__(self, workers: list[FakeWorker], router: LiveServer, extra: list[LiveServer]) -> None:
        self.workers, self.router, self.servers = workers, router, extra
        self.url = router.url
        self.app = router.server.config.app

    def worker_url(self, i: int) -> str:
        return self.servers[i].url


@pytest.fixture()
def cluster() -> Iterator[Callable[..., Cluster]]:
    opened: list[LiveServer] = []

    def make(num: int = 2, policy: str = "cache_aware", dead: int = 0, share_across_tenants: bool = False,
             **kwargs: Any) -> Cluster:
        fakes = [FakeWorker(f"w{i}") for i in range(num)]
        servers = [LiveServer(f.app).__enter__() for f in fakes]
        opened.extend(servers)
        urls = [s.url for s in servers] + [f"http://127.0.0.1:{free_port()}" for _ in range(dead)]
        config = PolicyConfig(policy=policy, share_across_tenants=share_across_tenants)  # type: ignore[arg-type]
        app = create_router_app(urls, config, FAST_HEALTH, **kwargs)
        router = LiveServer(app).__enter__()
        opened.append(router)
        return Cluster(fakes, router, servers)

    yield make
    for server in reversed(opened):
        server.__exit__(None, None, None)


def wait_for(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def events(resp: httpx.Response) -> list[Any]:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_relays_answers_and_keeps_each_prefix_on_one_worker(cluster: Callable[..., Cluster]) -> None:
    c = cluster(2)
    a, b = "A" * 200, "B" * 200
    with httpx.Client(base_url=c.url, timeout=10) as http:
        first = http.post("/generate", json={"text": a + " question 0"})
        assert first.status_code == 200 and first.json()["text"] == a + " question 0"
        home_a = first.headers["x-arbor-worker"]
        home_b = http.post("/generate", json={"text": b + " question 0"}).headers["x-arbor-worker"]
        assert home_a != home_b  # a new prefix goes to the idle, emptier worker
        for i in range(1, 6):
            assert http.post("/generate", json={"text": f"{a} question {i}"}).headers["x-arbor-worker"] == home_a
            assert http.post("/generate", json={"text": f"{b} question {i}"}).headers["x-arbor-worker"] == home_b
        assert http.get("/v1/models").json()["data"][0]["id"] in ("w0", "w1")  # a route it does not own
        metrics = samples(http.get("/metrics").text)
    assert metrics[("arbor_router_prefix_routed_ratio", ())] == pytest.approx(10 / 12)
    hit = metrics[("arbor_router_estimated_hit_rate", ())]
    assert 0.8 < hit < 10 / 12  # 10 of 12 requests matched their whole 201-character prefix
    assert metrics[("arbor_router_requests_total", (("reason", "prefix"), ("worker", home_a)))] == 5
    assert metrics[("arbor_router_worker_load", (("worker", home_a),))] == 0
    assert metrics[("arbor_router_worker_healthy", (("worker", home_b),))] == 1


@pytest.mark.parametrize("share", [False, True])
def test_a_tenants_prefix_routes_only_that_tenant(cluster: Callable[..., Cluster], share: bool) -> None:
    """Workers reuse a prefix only within a tenant (and cache_salt), so the router's index
    does too; with --router-share-across-tenants, tenants share it (salts still separate)."""
    c = cluster(2, share_across_tenants=share)
    text = "S" * 200
    with httpx.Client(base_url=c.url, timeout=10) as http:
        def home(headers: dict[str, str], **fields: Any) -> str:
            r = http.post("/v1/completions", json={"prompt": text, **fields}, headers=headers)
            return str(r.headers["x-arbor-worker"])

        first = home({"X-Tenant": "a"})
        other = next(s.url for s in c.servers if s.url != first)
        assert home({}, user="a") == first  # the user field names the same tenant
        # Another tenant's prompt is a new prefix (the emptier worker) unless tenants share.
        assert home({"X-Tenant": "b"}) == (first if share else other)
        if share:
            assert home({"X-Tenant": "b"}, cache_salt="s") == other  # a salt is still a namespace


def test_round_robin_alternates(cluster: Callable[..., Cluster]) -> None:
    c = cluster(2, policy="round_robin")
    with httpx.Client(base_url=c.url, timeout=10) as http:
        homes = [http.post("/generate", json={"text": "same prefix"}).headers["x-arbor-worker"] for _ in range(4)]
    assert homes[0] != homes[1] and homes[0::2] == [homes[0]] * 2 and homes[1::2] == [homes[1]] * 2


def test_streams_through_event_by_event(cluster: Callable[..., Cluster]) -> None:
    c = cluster(1)
    with httpx.Client(base_url=c.url, timeout=10) as http, \
            http.stream("POST", "/generate", json={"text": "x", "stream": True, "num_events": 4}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        got = events(resp)
    assert got == [{"worker": "w0", "i": i} for i in range(4)] + ["[DONE]"]


def test_a_client_leaving_a_stream_makes_the_worker_abort(cluster: Callable[..., Cluster]) -> None:
    c = cluster(1)
    with httpx.Client(base_url=c.url, timeout=10) as http, \
            http.stream("POST", "/generate", json={"text": "x", "stream": True, "num_events": 1000,
                                                   "delay": 0.02}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
    assert wait_for(lambda: c.workers[0].aborted == 1)
    assert wait_for(lambda: c.app.state.pool.workers[0].load == 0)


def test_a_client_leaving_a_whole_answer_makes_the_worker_abort(cluster: Callable[..., Cluster]) -> None:
    c = cluster(1)
    with httpx.Client(base_url=c.url, timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/generate", json={"text": "x", "delay": 30})
    assert wait_for(lambda: c.workers[0].aborted == 1)
    assert wait_for(lambda: c.app.state.pool.workers[0].load == 0)


def test_a_dead_worker_is_skipped_and_its_requests_retried(cluster: Callable[..., Cluster]) -> None:
    c = cluster(1, policy="round_robin", dead=1)
    with httpx.Client(base_url=c.url, timeout=10) as http:
        assert all(http.post("/generate", json={"text": f"q{i}"}).json()["worker"] == "w0" for i in range(4))
        health = http.get("/health").json()
    assert [w["healthy"] for w in health["workers"]] == [True, False]
    assert health["workers"][1]["last_error"]


def test_a_hung_worker_is_taken_out_and_its_requests_fail_or_retry(cluster: Callable[..., Cluster]) -> None:
    c = cluster(2, policy="round_robin")
    hung = c.workers[0]
    results: dict[str, Any] = {}
    with httpx.Client(base_url=c.url, timeout=10) as http:
        with http.stream("POST", "/generate", json={"text": "s", "stream": True, "num_events": 50,
                                                    "delay": 0.05}) as resp:
            lines = resp.iter_lines()
            first = next(lines)
            assert resp.headers["x-arbor-worker"] == c.worker_url(0) and '"i": 0' in first
            hung.stall, hung.healthy = True, False

            def whole(i: int) -> None:  # sent while w0 still counts as healthy: one lands there
                results[i] = http.post("/generate", json={"text": f"r{i}", "delay": 0.01})

            threads = [threading.Thread(target=whole, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
                time.sleep(0.01)
            started = time.monotonic()
            rest = [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                    for line in lines if line.startswith("data: ")]
            took = time.monotonic() - started
            for thread in threads:
                thread.join(10)
        assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == 503
        assert "failed mid-stream" in rest[-2]["error"]["message"]
        assert took < 3.0  # 2 failed probes 0.1 s apart, not the worker's 2.5 s of events
        assert [(r.status_code, r.json()["worker"]) for r in results.values()] == [(200, "w1")] * 2
        assert "r0" in hung.texts or "r1" in hung.texts  # one was sent to w0 first, then retried
        assert not http.get("/health").json()["workers"][0]["healthy"]
        hung.stall, hung.healthy = False, True  # it recovers: back in rotation
        assert wait_for(lambda: http.get("/health").json()["workers"][0]["healthy"])
        homes = {http.post("/generate", json={"text": f"z{i}"}).json()["worker"] for i in range(4)}
    assert homes == {"w0", "w1"}


def test_no_healthy_worker_is_a_503_with_a_message(cluster: Callable[..., Cluster]) -> None:
    c = cluster(1)
    c.workers[0].healthy = False
    with httpx.Client(base_url=c.url, timeout=10) as http:
        assert wait_for(lambda: http.get("/health").status_code == 503)
        resp = http.post("/generate", json={"text": "x"})
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["type"] == "service_unavailable" and "no healthy worker" in error["message"]
    assert "503" in error["message"]  # why the worker is out


def test_api_key_is_checked_and_relayed(cluster: Callable[..., Cluster]) -> None:
    c = cluster(1, api_key="k")
    with httpx.Client(base_url=c.url, timeout=10) as http:
        assert http.post("/generate", json={"text": "x"}).status_code == 401
        assert http.get("/health").status_code == 200
        ok = http.post("/generate", json={"text": "x"}, headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200 and ok.json()["auth"] == "Bearer k"


def test_an_oversized_body_is_refused_before_any_worker(cluster: Callable[..., Cluster]) -> None:
    c = cluster(1, max_body_bytes=1000)
    with httpx.Client(base_url=c.url, timeout=10) as http:
        resp = http.post("/generate", json={"text": "x" * 5000})
    assert resp.status_code == 413 and c.workers[0].texts == []
