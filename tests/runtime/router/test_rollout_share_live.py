"""Traffic share and stickiness over real workers (slow): two ``arbor serve`` processes
on the tiny test model behind ``arbor router --pool ... --plan ...`` (all three real
processes) at a fixed step (25% candidate). 1,000 routed requests over the three entry
points (native ``/generate``, ``/v1/completions``, ``/v1/chat/completions``), 500
sessions twice each, 8 at a time: the candidate's share is within ±3 points of the plan,
no session switches pool, every request is answered 200, and the router's panel counts
what the workers got. A tenth of the baseline's requests is shadowed on the candidate
(the same model and config): on all three routes the pairs compare (token ids, token
texts, or text) as identical, with a KL near 0 where logprobs were asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
NUM_REQUESTS = 1000
NUM_SESSIONS = 500
WEIGHT = 25


def start(argv: list[str], url: str, ready_path: str, procs: list[subprocess.Popen[bytes]]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", *argv], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    procs.append(proc)
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"{argv[0]} exited while starting"
        try:
            if httpx.get(url + ready_path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{argv[0]} at {url} did not start"
        time.sleep(0.25)


@pytest.fixture()
def routed(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """(router URL, {worker URL: pool}) with the plan at its first step."""
    procs: list[subprocess.Popen[bytes]] = []
    workers = {f"http://127.0.0.1:{free_port()}": pool for pool in ("baseline", "candidate")}
    plan = {"baseline": "baseline", "candidate": "candidate", "sticky": ["session"], "min_samples": 20,
            "steps": [{"weight": WEIGHT, "dwell_s": 3600}, {"weight": 100}],
            "gates": [{"metric": "error_rate", "max": 0.01}], "shadow": {"share": 0.1}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    router = f"http://127.0.0.1:{free_port()}"
    try:
        for url in workers:
            start(["serve", "--model", str(tiny_llama_dir), "--port", url.rsplit(":", 1)[1], "--num-threads", "1",
                   "--log-level", "warning"], url, "/health", procs)
        start(["router", "--port", router.rsplit(":", 1)[1], *[f"--pool={p}={u}" for u, p in workers.items()],
               "--plan", str(tmp_path / "plan.json"), "--rollout-db", str(tmp_path / "rollout.sqlite"),
               "--log-level", "warning"], router, "/rollout", procs)
        yield router, workers
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def request(i: int, model: str) -> tuple[str, dict[str, Any]]:
    """The i-th request: (path, body); the three entry points in turn, 2 output tokens,
    every other OpenAI one with top logprobs (completions: as token ids)."""
    text = f"Request {i}: say something."
    if i % 3 == 0:
        return "/generate", {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    tops: dict[str, Any] = {}
    if i % 3 == 1:
        if i % 2:
            tops = {"logprobs": 3, "return_tokens_as_token_ids": True}
        return "/v1/completions", {"model": model, "prompt": text, "max_tokens": 2, "temperature": 0, **tops}
    if i % 2:
        tops = {"logprobs": True, "top_logprobs": 3}
    return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                    "max_tokens": 2, "temperature": 0, **tops}


def test_share_and_stickiness_over_1000_requests_to_real_workers(routed: tuple[str, dict[str, str]]) -> None:
    router, workers = routed
    started = time.monotonic()
    with httpx.Client(base_url=router, timeout=120) as client:
        model = httpx.get(next(iter(workers)) + "/v1/models").json()["data"][0]["id"]  # NOTE: not via the router

        def send(i: int) -> tuple[str, int, str]:
            session = f"user-{i % NUM_SESSIONS}"
            path, body = request(i, model)
            resp = client.post(path, json=body, headers={"x-session-id": session})
            return session, resp.status_code, workers.get(resp.headers.get("x-arbor-worker", ""), "?")

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(send, range(NUM_REQUESTS)))
        took = time.monotonic() - started
        deadline = time.monotonic() + 60
        while True:  # NOTE: the shadow queue drains after the users are done
            status = client.get("/rollout").json()
            jobs = status["shadow"]["jobs"]
            done = sum(jobs.get(k, 0) for k in ("compared", "failed", "dropped_full", "dropped_load"))
            if done == jobs.get("offered", 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert Counter(code for _, code, _ in results) == {200: NUM_REQUESTS}
    pools_of: dict[str, set[str]] = {}
    for session, _, pool in results:
        pools_of.setdefault(session, set()).add(pool)
    assert len(pools_of) == NUM_SESSIONS and all(len(p) == 1 for p in pools_of.values())  # no session switched
    share = 100 * sum(pool == "candidate" for _, _, pool in results) / NUM_REQUESTS
    assert abs(share - WEIGHT) <= 3, share
    panel = status["panel"]
    assert panel["candidate"]["requests"] == sum(pool == "candidate" for _, _, pool in results)
    assert panel["baseline"]["requests"] + panel["candidate"]["requests"] == NUM_REQUESTS
    assert panel["candidate"]["errors"] == panel["baseline"]["errors"] == 0
    assert status["state"] == "progressing" and status["weights"] == {"candidate": WEIGHT, "baseline": 100 - WEIGHT}
    shadow = status["shadow"]
    assert shadow["jobs"]["compared"] >= 20 and shadow["jobs"].get("failed", 0) == 0
    assert set(shadow["units"]) == {"ids", "tokens", "text"}
    # NOTE: the same weights and config; batches differ, so allow a rare float-level flip
    assert shadow["exact_match"] >= 0.9 and shadow["kl_pairs"] > 0 and shadow["mean_kl"] < 0.01
    print(f"{NUM_REQUESTS} requests in {took:.1f} s: candidate share {share:.1f}% (plan {WEIGHT}%); "
          f"shadow {shadow}")
