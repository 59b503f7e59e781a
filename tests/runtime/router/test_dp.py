"""``arbor serve --dp 2`` end to end: two real engine worker processes (the tiny test
model) behind the router, driven over HTTP like a user would, and one killed under load."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
PROGRAMS = REPO / "tests" / "runtime" / "server" / "programs_fixture.py"
SYSTEM = "You are a terse assistant for the Arbor router tests. Answer in one line. " * 4


@pytest.fixture(scope="module")
def dp(tiny_llama_dir: Path) -> Iterator[dict[str, Any]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "serve", "--dp", "2", "--model", str(tiny_llama_dir),
         "--num-pages", "4096", "--max-model-len", "2048", "--port", str(port), "--programs", str(PROGRAMS),
         "--health-interval", "0.2", "--health-timeout", "1", "--log-level", "warning"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, "arbor serve --dp 2 exited while starting"
            try:
                health = httpx.get(f"{url}/health", timeout=2).json()
                if all(w["healthy"] for w in health["workers"]):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.3)
        yield {"url": url, "workers": [w["url"] for w in health["workers"]]}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def worker_pid(url: str) -> int:
    """The pid of the `arbor serve` worker listening on ``url``'s port (its command line)."""
    port = url.rsplit(":", 1)[1]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode():
                return int(entry.name)
    raise AssertionError(f"no worker process on port {port}")


def generate(url: str, text: str, max_tokens: int = 8, **extra: Any) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}, **extra}
    return httpx.post(f"{url}/generate", json=body, timeout=60)


def test_dp_serves_the_whole_api_and_keeps_a_prefix_on_one_worker(dp: dict[str, Any]) -> None:
    url = dp["url"]
    first = generate(url, SYSTEM + "Question 1?")
    assert first.status_code == 200, first.text
    again = generate(url, SYSTEM + "Question 1?")
    assert again.json()["output_ids"] == first.json()["output_ids"]  # greedy, either worker
    homes, cached = set(), []
    for i in range(2, 6):
        resp = generate(url, SYSTEM + f"Question {i}?")
        homes.add(resp.headers["x-arbor-worker"])
        cached.append(resp.json()["meta"]["cached_tokens"])
    assert len(homes) == 1 and min(cached) >= 60  # the ~80-token system prompt came from the cache
    served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    unknown = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "not-served", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert unknown.status_code == 404  # the worker's answer, relayed
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": served, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    names = {p["name"] for p in httpx.get(f"{url}/programs", timeout=10).json()["programs"]}
    assert {"qa", "two_steps"} <= names
    run = httpx.post(f"{url}/programs/qa", json={"arguments": {"question": "2+2?"}}, timeout=60)
    assert run.status_code == 200 and "answer" in run.json()["variables"]
    with httpx.stream("POST", f"{url}/generate", timeout=60, json={
            "text": "Count:", "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[-1]["finish_reason"] is not None and len(chunks[-1]["output_ids"]) == 6
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "arbor_router_estimated_hit_rate" in metrics and "arbor_router_worker_load" in metrics


def test_a_client_leaving_frees_the_workers_requests(dp: dict[str, Any]) -> None:
    url = dp["url"]
    long = {"max_new_tokens": 1600, "temperature": 0, "ignore_eos": True}
    started = time.monotonic()
    assert httpx.post(f"{url}/generate", timeout=60, json={"text": "Warm up:", "sampling_params": long}
                      ).status_code == 200
    whole = time.monotonic() - started  # what a request left running would take
    print(f"a whole {long['max_new_tokens']}-token generation: {whole:.2f} s")
    with httpx.stream("POST", f"{url}/generate", timeout=60, json={
            "text": "Tell a long story:", "stream": True, "sampling_params": long}) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("data: ")
    wait_until_idle(dp["workers"], within=whole / 3)
    # A whole answer: the client hangs up while the worker generates.
    body = json.dumps({"text": "Tell another story:", "sampling_params": long}).encode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while not any(running(w) for w in dp["workers"]):
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    wait_until_idle(dp["workers"], within=whole / 3)


def running(worker: str) -> int:
    return int(httpx.get(f"{worker}/engine_metrics", timeout=5).json()["num_running"])


def wait_until_idle(workers: list[str], within: float) -> None:
    deadline = time.monotonic() + within
    while any(running(w) > 0 for w in workers):
        assert time.monotonic() < deadline, f"a worker kept generating for {within:.1f} s for a client that left"
        time.sleep(0.1)



def test_killing_a_worker_under_load(dp: dict[str, Any]) -> None:
    url = dp["url"]

    def one(i: int) -> tuple[str, float]:
        started = time.monotonic()
        params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}  # in flight at the kill
        if i % 2:
            with httpx.stream("POST", f"{url}/generate", timeout=60,
                              json={"text": f"{SYSTEM} stream {i}", "stream": True, "sampling_params": params}) as s:
                if s.status_code != 200:
                    s.read()
                    return _outcome(s.status_code, s.json()), time.monotonic() - started
                events = [json.loads(line[6:]) for line in s.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            last = events[-1]
            return ("error" if "error" in last else "ok") if last.get("error", {}).get("code", 503) == 503 \
                else "bad", time.monotonic() - started
        resp = httpx.post(f"{url}/generate", timeout=60, json={"text": f"q {i}", "sampling_params": params})
        return _outcome(resp.status_code, resp.json()), time.monotonic() - started

    def guarded(i: int) -> tuple[str, float]:
        try:
            return one(i)
        except httpx.HTTPError as exc:  # the router dropped the connection: a bug
            return f"transport error {exc!r}", 0.0

    # The victim: the worker that holds SYSTEM, where the streams (keyed by it) will go.
    victim = generate(url, SYSTEM + " where?").headers["x-arbor-worker"]
    v, survivor = dp["workers"].index(victim), dp["workers"][1 - dp["workers"].index(victim)]
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(guarded, i) for i in range(16)]
        deadline = time.monotonic() + 30  # kill once the victim certainly holds requests in flight
        while running(victim) == 0:
            assert time.monotonic() < deadline, "no request reached the victim"
            time.sleep(0.02)
        os.kill(worker_pid(victim), signal.SIGKILL)
        outcomes = [f.result(timeout=90) for f in futures]
    assert all(kind in ("ok", "error") for kind, _ in outcomes), outcomes
    assert all(took < 60 for _, took in outcomes)
    assert sum(kind == "ok" for kind, _ in outcomes) >= 8  # the survivor's share, and the retried
    assert sum(kind == "error" for kind, _ in outcomes) >= 1  # the victim's streams were cut
    health = httpx.get(f"{url}/health", timeout=5).json()
    assert not health["workers"][v]["healthy"], health  # taken out by the failed requests
    for i in range(4):  # the router keeps serving on the survivor
        resp = generate(url, f"after {i}")
        assert resp.status_code == 200 and resp.headers["x-arbor-worker"] == survivor
    deadline = time.monotonic() + 120  # `--dp` starts the dead worker again; it comes back
    while not httpx.get(f"{url}/health", timeout=5).json()["workers"][v]["healthy"]:
        assert time.monotonic() < deadline, "the restarted worker never came back"
        time.sleep(0.5)
    assert generate(victim, "direct").status_code == 200


def _outcome(status: int, body: dict[str, Any]) -> str:
    if status == 200:
        return "ok"
    return "error" if status == 503 and body["error"]["message"] else "bad"
