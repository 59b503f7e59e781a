"""A rollout over real workers: ``arbor serve`` processes on the default model behind the
router (slow: three engines start). The baseline runs fp32 KV; a good candidate int8 KV;
a bad candidate the baseline's config with the ``--fault-delay-ms`` test hook.

- the shadow statistics on live traffic equal an offline ``arbor eval`` replay of the
  same prompts on the same two servers, where they overlap (greedy match, the share of
  tokens before the first difference, top-20 KL over the shared positions);
- the slow candidate is rolled back automatically within the gate's window, for the
  recorded reason, with no failed user request.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import LiveServer, free_port

from runtime.router.app import create_router_app
from runtime.router.config import HealthConfig
from runtime.router.pools import Pools
from runtime.router.rollout_plan import plan_from_dict

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
HEALTH = HealthConfig(interval_s=0.5, timeout_s=5.0, failures_to_remove=3)
FAULT_DELAY_MS = 1500
WORKERS = {"baseline": [], "good": ["--kv-cache-dtype", "int8"], "bad": ["--fault-delay-ms", str(FAULT_DELAY_MS)]}


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, str]]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    urls: dict[str, str] = {}
    try:
        for name, flags in WORKERS.items():
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "runtime.cli", "serve", "--port", str(port), "--num-threads", "1",
                 "--max-model-len", "1024", "--num-pages", "512", "--log-level", "warning",
                 # NOTE: fp32, whose greedy tokens do not depend on the batch they ran in (the
                 # GGUF kernels' multi-row steps can flip near-ties), as the offline eval's
                 "--weights", "fp32", *flags],
                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        deadline = time.monotonic() + 300
        pending = set(urls)
        while pending:
            for name in sorted(pending):
                assert procs[name].poll() is None, f"worker {name} exited while starting"
                try:
                    if httpx.get(urls[name] + "/health", timeout=2).status_code == 200:
                        pending.discard(name)
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, f"workers {pending} did not start"
            time.sleep(0.5)
        yield urls
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def router(base: str, cand: str, plan: dict[str, Any]) -> LiveServer:
    pools, urls = Pools.parse([f"baseline={base}", f"candidate={cand}"])
    full = {"baseline": "baseline", "candidate": "candidate", "interval_s": 0.2, **plan}
    return LiveServer(create_router_app(urls, health=HEALTH, pools=pools, plan=plan_from_dict(full, pools.names)))


def test_shadow_statistics_equal_an_offline_eval_of_the_same_prompts(workers: dict[str, str]) -> None:
    from runtime.eval.replay import greedy_match, mean_kl
    from runtime.eval.samples import load_samples
    from runtime.eval.targets import GenParams, ServerTarget

    num_tokens = 8
    plan = {"steps": [{"weight": 0, "dwell_s": 3600}, {"weight": 100}], "shadow": {"share": 1.0}}
    base, cand = ServerTarget(workers["baseline"]), ServerTarget(workers["good"])
    prompts = [base.encode(p) for p in load_samples().prompts[:3]]
    with router(workers["baseline"], workers["good"], plan) as srv:
        canary = srv.server.config.app.state.canary  # type: ignore[union-attr]
        pairs: list[Any] = []
        canary.shadow_totals.add = pairs.append  # type: ignore[method-assign]  # NOTE: keep each pair
        for i, ids in enumerate(prompts):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": num_tokens, "temperature": 0.0,
                                                          "ignore_eos": True, "top_logprobs": 20}}
            resp = httpx.post(srv.url + "/generate", json=body, headers={"x-session-id": f"s{i}"}, timeout=120)
            assert resp.status_code == 200 and resp.headers["x-arbor-worker"] == workers["baseline"]
        deadline = time.monotonic() + 120
        while len(pairs) < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(pairs) == len(prompts)
        assert canary.shadow.counts["compared"] == len(prompts)
    try:
        params = GenParams(max_new_tokens=num_tokens, ignore_eos=True)
        base_out, cand_out = base.generate(prompts, params), cand.generate(prompts, params)
        exact, prefix = greedy_match(base_out, cand_out)
        assert sum(p.exact for p in pairs) / len(pairs) == exact
        assert sum(p.prefix_share for p in pairs) / len(pairs) == pytest.approx(prefix)
        # the KL of one pair, offline: eval's top-20 positions over the prompt and the shared
        # output prefix; the rows of the generated positions are the prompt's last onwards
        ids, b_out, pair = prompts[0], base_out[0].token_ids, pairs[0]
        shared = pair.kl_positions
        rows = slice(len(ids) - 1, len(ids) - 1 + shared)
        b_dists, c_dists = base.position_dists(ids + b_out[:shared - 1]), cand.position_dists(ids + b_out[:shared - 1])
        offline = mean_kl(type(b_dists)(b_dists.top_ids[rows], b_dists.top_logprobs[rows], None),
                          type(c_dists)(c_dists.top_ids[rows], c_dists.top_logprobs[rows], None))[0]
        # NOTE: decode-time and prefill-time logprobs differ by float rounding only
        assert pair.kl == pytest.approx(offline, rel=0.05, abs=2e-4)
    finally:
        base.close()
        cand.close()


def test_a_slow_candidate_is_rolled_back_within_the_window_with_no_failed_request(workers: dict[str, str]) -> None:
    window_s = 60.0
    plan = {"steps": [{"weight": 50, "dwell_s": 3600}, {"weight": 100}], "window_s": window_s, "min_samples": 4,
            "gates": [{"metric": "error_rate", "max": 0.05}, {"metric": "e2e_p99_ratio", "max": 1.5}]}
    statuses: list[int] = []
    with router(workers["baseline"], workers["bad"], plan) as srv:
        canary = srv.server.config.app.state.canary  # type: ignore[union-attr]
        started = time.monotonic()

        def user(i: int) -> int:
            body = {"text": f"User {i} asks: name a colour.", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            return httpx.post(srv.url + "/generate", json=body, headers={"x-session-id": f"user-{i}"},
                              timeout=120).status_code

        with ThreadPoolExecutor(2) as pool:
            i = 0
            while canary.rollout.state != "rolled_back" and time.monotonic() - started < window_s:
                statuses += pool.map(user, range(i, i + 4))
                i += 4
        took = time.monotonic() - started
        status = httpx.get(srv.url + "/rollout").json()
    assert status["state"] == "rolled_back" and status["weights"] == {"baseline": 100}
    assert took < window_s
    event = status["events"][-1]
    assert event["kind"] == "rollback" and event["detail"]["gate"] == "e2e_p99_ratio"
    assert event["detail"]["value"] > 1.5 and event["detail"]["samples"] >= 4
    assert statuses and set(statuses) == {200}
    panel = status["panel"]
    assert panel["candidate"]["e2e_s"]["p50"] > FAULT_DELAY_MS / 1000 > panel["baseline"]["e2e_s"]["p50"]
    print(f"rolled back after {took:.1f} s and {len(statuses)} requests: {event['detail']['why']}")
