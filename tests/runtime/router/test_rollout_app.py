"""A rollout through the router's HTTP front over fake workers (fast): shares and
stickiness over 1,000 routed requests, split metrics, the admin API and ``arbor
rollout``, a failing candidate rolled back with no user request lost, shadow replay."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from server_helpers import LiveServer

from runtime.cli import main
from runtime.router.app import create_router_app
from runtime.router.config import HealthConfig, PolicyConfig
from runtime.router.pools import Pools
from runtime.router.rollout_plan import plan_from_dict

FAST_HEALTH = HealthConfig(interval_s=0.1, timeout_s=0.5, failures_to_remove=2)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels include ``labels`` (None: absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


class VersionedWorker:
    """A stand-in for ``arbor serve``: native ``/generate`` answers with version headers."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.delay_s = 0.0
        self.status = 200  # what /generate answers
        self.shift = 0  # added to every output token (a candidate that answers differently)
        self.seen = 0
        self.valid = True  # the constraint check of constrained answers
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()
        headers = {"x-arbor-model": "m", "x-arbor-config-version": self.version}

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse({"status": "ok"}, headers=headers)

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            body = await request.json()
            self.seen += 1
            await asyncio.sleep(self.delay_s)
            if self.status != 200:
                return JSONResponse({"error": {"message": "boom", "code": self.status}}, self.status, headers=headers)
            ids = self._ids(body.get("text", ""))
            tops = [{str(t): -0.1, str(t + 1000): -2.5} for t in ids]
            meta: dict[str, Any] = {"prompt_tokens": 700, "completion_tokens": 4, "cached_tokens": 100,
                                    "top_logprobs": tops}
            if "constraint" in body.get("sampling_params", {}):
                meta["constraint_check"] = {"valid": self.valid, "checked": True}
            answer = {"text": "x", "output_ids": ids, "finish_reason": "length", "meta": meta}
            if body.get("stream"):
                return StreamingResponse(self._events(answer), media_type="text/event-stream", headers=headers)
            return JSONResponse(answer, headers=headers)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.seen += 1
            ids = self._ids(body.get("prompt", ""))
            name = (lambda t: f"token_id:{t}") if body.get("return_tokens_as_token_ids") else (lambda t: f"t{t}")
            choice: dict[str, Any] = {"index": 0, "text": "".join(f"t{t}" for t in ids), "finish_reason": "length"}
            if body.get("logprobs"):
                choice["logprobs"] = {"tokens": [name(t) for t in ids], "token_logprobs": [-0.1] * len(ids),
                                      "top_logprobs": [{name(t): -0.1, name(t + 1000): -2.5} for t in ids],
                                      "text_offset": list(range(len(ids)))}
            return JSONResponse({"object": "text_completion", "choices": [choice],
                                 "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, headers=headers)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = await request.json()
            self.seen += 1
            ids = self._ids(body["messages"][-1]["content"])
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "message": {
                "role": "assistant", "content": "".join(f"t{t}" for t in ids)}}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {"token": f"t{t}", "logprob": -0.1, "bytes": None, "top_logprobs": [
                        {"token": f"t{t}", "logprob": -0.1, "bytes": None},
                        {"token": f"t{t + 1000}", "logprob": -2.5, "bytes": None}][:body.get("top_logprobs", 0)]}
                    for t in ids]}
            return JSONResponse({"object": "chat.completion", "choices": [choice],
                                 "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, headers=headers)

        return app

    def _ids(self, text: str) -> list[int]:
        """The output: 4 tokens from the prompt's length; the candidate's last two shifted."""
        return [len(text) + i + (self.shift if i >= 2 else 0) for i in range(4)]

    async def _events(self, answer: dict[str, Any]) -> AsyncIterator[str]:
        *head, last = answer["output_ids"]
        for token in head:
            await asyncio.sleep(0.05)
            yield f"data: {json.dumps({'delta_text': 'x', 'delta_token_ids': [token]})}\n\n"
        await asyncio.sleep(0.05)  # NOTE: the last event carries the last token and the meta
        yield f"data: {json.dumps({**answer, 'delta_text': 'x', 'delta_token_ids': [last]})}\n\n"
        yield "data: [DONE]\n\n"


class Setup:
    def __init__(self, base: VersionedWorker, cand: VersionedWorker, router: LiveServer) -> None:
        self.base, self.cand, self.router = base, cand, router
        self.url = router.url
        self.canary = router.server.config.app.state.canary  # type: ignore[union-attr]

    def generate(self, client: httpx.Client, session: str, **extra: Any) -> httpx.Response:
        body = {"text": "hello", "sampling_params": {"temperature": 0.0}, **extra}
        return client.post(self.url + "/generate", json=body, headers={"x-session-id": session})


@pytest.fixture()
def setup() -> Iterator[Callable[..., Setup]]:
    opened: list[LiveServer] = []

    def make(**plan_over: Any) -> Setup:
        base, cand = VersionedWorker("base-v1"), VersionedWorker("cand-v2")
        servers = [LiveServer(w.app).__enter__() for w in (base, cand)]
        opened.extend(servers)
        pools, urls = Pools.parse([f"baseline={servers[0].url}", f"candidate={servers[1].url}"])
        plan = plan_from_dict({"baseline": "baseline", "candidate": "candidate",
                               "steps": [{"weight": 25, "dwell_s": 3600}, {"weight": 100}],
                               "interval_s": 0.05, **plan_over}, pools.names)
        app = create_router_app(urls, PolicyConfig(), FAST_HEALTH, pools=pools, plan=plan)
        router = LiveServer(app).__enter__()
        opened.append(router)
        return Setup(base, cand, router)

    yield make
    for server in reversed(opened):
        server.__exit__(None, None, None)


def test_shares_and_stickiness_over_1000_routed_requests(setup: Callable[..., Setup]) -> None:
    s = setup()
    first: dict[str, str] = {}
    switched = 0
    with httpx.Client(timeout=30) as client:
        for i in range(1000):
            session = f"user-{i % 500}"  # NOTE: each session twice: the second must land where the first did
            resp = s.generate(client, session)
            assert resp.status_code == 200
            version = resp.headers["x-arbor-config-version"]
            switched += first.setdefault(session, version) != version
    assert switched == 0
    assert abs(s.cand.seen / 10 - 25) <= 3 and s.base.seen + s.cand.seen == 1000
    metrics = httpx.get(s.url + "/metrics").text
    labels = {"pool": "candidate", "model": "m", "config_version": "cand-v2", "tenant": "none",
              "entry_point": "/generate", "context": "512-2k"}
    assert metric(metrics, "arbor_router_split_requests_total", status="200", **labels) == s.cand.seen
    assert metric(metrics, "arbor_router_split_ttft_seconds_count", **labels) == s.cand.seen
    assert metric(metrics, "arbor_router_split_cached_tokens_total", **labels) == 100 * s.cand.seen
    assert metric(metrics, "arbor_rollout_weight", pool="candidate") == 25
    panel = httpx.get(s.url + "/rollout").json()["panel"]
    assert panel["candidate"]["requests"] == s.cand.seen and panel["candidate"]["ttft_s"]["samples"] == s.cand.seen
    assert panel["baseline"]["versions"] == ["m@base-v1"]


def test_a_failing_candidate_is_rolled_back_and_no_user_request_fails(setup: Callable[..., Setup]) -> None:
    s = setup(gates=[{"metric": "error_rate", "max": 0.05}], min_samples=5)
    s.cand.status = 503
    statuses = []
    started = time.monotonic()
    with httpx.Client(timeout=30) as client:
        for i in range(200):
            statuses.append(s.generate(client, f"u{i}").status_code)
            if s.canary.rollout.state == "rolled_back":
                break
    status = httpx.get(s.url + "/rollout").json()
    assert status["state"] == "rolled_back" and status["weights"] == {"baseline": 100}
    rollback = status["events"][-1]
    assert rollback["kind"] == "rollback" and rollback["detail"]["gate"] == "error_rate"
    assert rollback["detail"]["value"] > 0.05 and rollback["detail"]["samples"] >= 5
    assert time.monotonic() - started < 10
    # NOTE: a candidate's 5xx is retried on the baseline before it reaches the user
    assert statuses == [200] * len(statuses) and s.cand.seen >= 5
    seen = s.cand.seen
    with httpx.Client(timeout=30) as client:
        assert all(s.generate(client, f"u{i}").status_code == 200 for i in range(40))
    assert s.cand.seen == seen  # rolled back: the candidate gets nothing more
    assert metric(httpx.get(s.url + "/metrics").text, "arbor_rollout_rollbacks_total", gate="error_rate") == 1


def test_streams_give_itl_and_invalid_constrained_outputs_fail_their_gate(setup: Callable[..., Setup]) -> None:
    s = setup(steps=[{"weight": 100, "dwell_s": 3600}, {"weight": 100}], min_samples=3,
              gates=[{"metric": "constraint_failure_rate", "max": 0.1}])
    s.cand.valid = False
    with httpx.Client(timeout=30) as client:
        streamed = client.post(s.url + "/generate", json={"text": "hi", "stream": True}, headers={"x-session-id": "a"})
        assert streamed.text.count("data:") == 5
        for i in range(3):
            body = {"text": "hi", "sampling_params": {"constraint": {"regex": "[a-z]+"}}}
            assert client.post(s.url + "/generate", json=body, headers={"x-session-id": f"c{i}"}).status_code == 200
    panel = httpx.get(s.url + "/rollout").json()["panel"]["candidate"]
    assert panel["itl_s"]["samples"] == 1 and 0.04 <= panel["itl_s"]["p50"] <= 0.5
    assert panel["ttft_s"]["p50"] < panel["e2e_s"]["p99"]
    metrics = httpx.get(s.url + "/metrics").text
    assert metric(metrics, "arbor_router_split_constraint_failures_total", pool="candidate") == 3
    assert metric(metrics, "arbor_router_split_output_tokens_total", pool="candidate") == 16
    deadline = time.monotonic() + 5
    while s.canary.rollout.state != "rolled_back" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.canary.rollout.store.events()[-1].detail["gate"] == "constraint_failure_rate"


def test_a_dead_candidate_loses_no_request_and_rolls_back(setup: Callable[..., Setup]) -> None:
    s = setup(gates=[{"metric": "error_rate", "max": 0.05}], min_samples=5)
    s.canary.workers.workers[1].url = "http://127.0.0.1:9"  # NOTE: nothing listens there: connections fail
    with httpx.Client(timeout=30) as client:
        statuses = [s.generate(client, f"u{i}").status_code for i in range(100)]
    assert statuses == [200] * 100  # retried on the baseline before anything reached the client
    deadline = time.monotonic() + 5
    while s.canary.rollout.state != "rolled_back" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.canary.rollout.state == "rolled_back"
    assert s.canary.rollout.store.events()[-1].detail["gate"] in ("candidate_healthy", "error_rate")


def test_shadow_pairs_are_compared_and_exported(setup: Callable[..., Setup]) -> None:
    s = setup(steps=[{"weight": 0, "dwell_s": 3600}, {"weight": 100}], shadow={"share": 1.0, "queue_cap": 64},
              gates=[{"metric": "shadow_exact_match", "min": 0.9, "min_samples": 4}])
    s.cand.shift = 1  # the candidate's third and fourth tokens differ
    with httpx.Client(timeout=30) as client:
        for i in range(4):
            body = {"text": "hello", "sampling_params": {"temperature": 0.0, "top_logprobs": 2}}
            assert client.post(s.url + "/generate", json=body, headers={"x-session-id": f"s{i}"}).json()[
                "output_ids"] == [5, 6, 7, 8]  # the user gets the baseline's answer
    deadline = time.monotonic() + 5
    while s.canary.shadow_totals.pairs < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    shadow = httpx.get(s.url + "/rollout").json()["shadow"]
    assert shadow["pairs"] == 4 and shadow["exact_match"] == 0.0 and shadow["prefix_share"] == 0.5
    # KL over the 3 shared positions (the divergence's included); only there the tops differ:
    # both baseline tokens fall outside the candidate's top-2 and get its floor (-2.5)
    assert shadow["length_ratio"] == 1.0 and shadow["mean_kl"] == pytest.approx(math.exp(-0.1) * 2.4 / 3)
    metrics = httpx.get(s.url + "/metrics").text
    assert metric(metrics, "arbor_rollout_shadow_exact_match") == 0.0
    assert metric(metrics, "arbor_rollout_shadow_jobs_total", outcome="compared") == 4
    # weight 0 at this step: the gates do not run (nothing of the candidate's is at stake)
    assert s.canary.rollout.state == "progressing"


def test_openai_routes_are_shadowed_on_ids_token_texts_or_text(setup: Callable[..., Setup]) -> None:
    s = setup(steps=[{"weight": 0, "dwell_s": 3600}, {"weight": 100}], shadow={"share": 1.0, "queue_cap": 64})
    s.cand.shift = 1  # the candidate's third and fourth tokens differ
    requests = [  # (route, body, the unit compared, KL expected)
        ("/v1/completions", {"prompt": "hello", "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True},
         "ids", True),
        ("/v1/completions", {"prompt": "hello", "temperature": 0}, "text", False),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "temperature": 0,
                                  "logprobs": True, "top_logprobs": 2}, "tokens", True),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "stream": True}, None, False),
    ]
    pairs: list[Any] = []
    s.canary.shadow_totals.add = pairs.append  # type: ignore[method-assign]  # NOTE: keep each pair
    with httpx.Client(timeout=30) as client:
        for i, (route, body, _, _) in enumerate(requests):
            resp = client.post(s.url + route, json=body, headers={"x-session-id": f"o{i}"})
            assert resp.status_code == 200 and resp.headers["x-arbor-config-version"] == "base-v1"
    deadline = time.monotonic() + 5
    while len(pairs) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    assert [p.unit for p in pairs] == ["ids", "text", "tokens"]  # the stream was not shadowed
    assert s.cand.seen == 3 and s.canary.shadow.counts["compared"] == 3
    ids, text, tokens = pairs
    assert all(p.greedy and not p.exact and p.length_ratio == 1.0 for p in pairs)
    # the baseline's "5 6 7 8" against the candidate's "5 6 8 9": divergence at the third token
    assert (ids.first_divergence, ids.prefix_share) == (2, 0.5) and (tokens.first_divergence, tokens.prefix_share) == (
        2, 0.5)
    assert ids.kl == tokens.kl == pytest.approx(math.exp(-0.1) * 2.4 / 3) and text.kl is None
    assert text.first_divergence == 5 and text.prefix_share == pytest.approx(5 / 8)  # "t5t6t7t8" vs "t5t6t8t9"


def test_admin_api_and_the_rollout_command(setup: Callable[..., Setup], capsys: pytest.CaptureFixture[str]) -> None:
    s = setup()
    assert main(["rollout", "pause", "--router", s.url, "--reason", "look"]) == 0
    assert "state paused at step 1/2 (candidate 25%, baseline 75%)" in capsys.readouterr().out
    assert main(["rollout", "weight", "40", "--router", s.url]) == 0
    assert httpx.get(s.url + "/rollout").json()["weights"] == {"candidate": 40, "baseline": 60}
    assert main(["rollout", "promote", "--router", s.url]) == 0
    capsys.readouterr()
    deadline = time.monotonic() + 5  # NOTE: the last step completes on the next check
    while s.canary.rollout.state != "completed" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert main(["rollout", "status", "--router", s.url, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "completed" and status["weights"]["candidate"] == 100
    assert main(["rollout", "promote", "--router", s.url]) == 1
    assert "already complete" in capsys.readouterr().err
    assert main(["rollout", "rollback", "--router", s.url, "--reason", "manual"]) == 0
    assert httpx.get(s.url + "/rollout").json()["reason"] == "manual"
    resp = httpx.post(s.url + "/rollout/weight", json={"weight": "x"})
    assert resp.status_code == 409 and "whole percent" in resp.json()["error"]["message"]
    assert httpx.post(s.url + "/rollout/pause", content=b"[").status_code == 400


def test_rollout_against_a_router_without_a_plan_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    worker = VersionedWorker("v")
    with LiveServer(worker.app) as w, LiveServer(create_router_app([w.url], health=FAST_HEALTH)) as router:
        assert main(["rollout", "status", "--router", router.url]) == 2
        assert "has no rollout plan" in capsys.readouterr().err
        assert httpx.get(router.url + "/rollout").status_code == 404
        # the split metrics are there without a plan too (pool "default")
        httpx.post(router.url + "/generate", json={"text": "hi"})
        text = httpx.get(router.url + "/metrics").text
        assert metric(text, "arbor_router_split_requests_total", pool="default", config_version="v") == 1


@pytest.mark.parametrize(("plan", "message"), [
    ({"baseline": "baseline", "candidate": "canary", "steps": [{"weight": 5}]}, "is not one of the router's pools"),
    ({"candidate": "candidate", "steps": [{"weight": 5}]}, "names no baseline pool"),
    ({"baseline": "baseline", "candidate": "candidate", "steps": [{"weights": {"baseline": 50, "candidate": 40}}]},
     "add up to 90"),
    ({"baseline": "baseline", "candidate": "candidate", "steps": [{"weight": 5}],
      "gates": [{"metric": "vibes", "min": 1}]}, "gate on unknown metric 'vibes'"),
])
def test_router_refuses_a_bad_plan_at_start(tmp_path: Path, plan: dict[str, Any], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    argv = ["router", "--pool", "baseline=http://127.0.0.1:9", "--pool", "candidate=http://127.0.0.1:10",
            "--plan", str(path), "--rollout-db", str(tmp_path / "db.sqlite")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert main(["router", "--workers", "http://a:1", "--plan", str(path)]) == 2
    assert "needs named pools" in capsys.readouterr().err


def test_arbor_router_with_a_plan_keeps_its_state_across_a_restart(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import signal
    import subprocess
    import sys

    from server_helpers import free_port

    repo = Path(__file__).resolve().parents[3]
    plan = {"baseline": "baseline", "candidate": "candidate", "steps": [{"weight": 10, "dwell_s": 3600},
                                                                        {"weight": 100}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    base, cand = VersionedWorker("b"), VersionedWorker("c")
    with LiveServer(base.app) as b, LiveServer(cand.app) as c:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "runtime.cli", "router", "--port", str(port), "--pool", f"baseline={b.url}",
                "--pool", f"candidate={c.url}", "--plan", str(tmp_path / "plan.json"),
                "--rollout-db", str(tmp_path / "rollout.sqlite"), "--log-level", "warning"]

        def start() -> subprocess.Popen[bytes]:
            proc = subprocess.Popen(argv, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, "arbor router exited"
                try:
                    if httpx.get(url + "/rollout", timeout=2).status_code == 200:
                        return proc
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.2)

        def stop(proc: subprocess.Popen[bytes]) -> None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)

        proc = start()
        try:
            assert main(["rollout", "weight", "30", "--router", url]) == 0
        finally:
            stop(proc)
        proc = start()  # NOTE: the same SQLite file: the same state
        try:
            status = httpx.get(url + "/rollout").json()
            assert (status["state"], status["weights"]) == ("paused", {"candidate": 30, "baseline": 70})
            assert [e["kind"] for e in status["events"]] == ["start", "set_weight"]
        finally:
            stop(proc)
    capsys.readouterr()
