"""DP=2 on a shared-prefix workload: the cache-aware router vs round robin, in one run.

Workload: ``--prompts`` system prompts x ``--per-prompt`` requests (a system prompt, then
a short distinct question), shuffled with a fixed seed, sent ``--concurrency`` at a time
to a router in front of 2 ``arbor serve`` workers (the default model, one torch thread
each). For each policy the workers are started fresh (empty caches), then stopped.
Reports, per policy: hit rate = cached / prompt tokens over all answers (the workers'
own ``meta.cached_tokens``), requests/s and output tokens/s over the whole workload, and
the router's own estimated hit rate. The KV pool per worker (``--num-pages``) decides how
many system prompts a worker can keep next to its running requests: with the default, one
worker cannot hold all of them, which is the case the router is for.

    .venv/bin/python benchmarks/bench_router_dp.py [--prompts 4] [--per-prompt 32] [--num-pages 1536]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, reproduce_line, save_result  # noqa: E402

from runtime.router.app import create_router_app  # noqa: E402
from runtime.router.config import HealthConfig, PolicyConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOPICS = ["a travel agency for mountain trips", "a bank's customer support desk",
          "a library that lends rare maps", "a bicycle repair shop", "a clinic's appointment desk",
          "a museum of old clocks", "a tea importer", "a city's parking office"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def system_prompt(i: int) -> str:
    rules = " ".join(f"Rule {k}: answer about {TOPICS[i % len(TOPICS)]} politely, in one short line, "
                     f"and never mention rule {k + 1}." for k in range(12))
    return f"You are the assistant of {TOPICS[i % len(TOPICS)]} (desk {i}). {rules}\nQuestion: "


def start_workers(args: argparse.Namespace) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    ports = [free_port() for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--model", args.model,
                               "--num-threads", "1", "--num-pages", str(args.num_pages), "--port", str(p),
                               "--log-level", "warning"], cwd=REPO) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    deadline = time.monotonic() + 600
    for url in urls:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("a worker did not start")
            time.sleep(0.5)
    return procs, urls


def run_policy(policy: str, args: argparse.Namespace, jobs: list[str]) -> dict[str, Any]:
    procs, urls = start_workers(args)
    app = create_router_app(urls, PolicyConfig(policy=policy), HealthConfig())  # type: ignore[arg-type]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
            def one(text: str) -> dict[str, Any]:
                body = {"text": text, "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 0,
                                                          "ignore_eos": True}}
                resp = http.post("/generate", json=body)
                resp.raise_for_status()
                out: dict[str, Any] = resp.json()["meta"]
                return out

            started = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                metas = list(pool.map(one, jobs))
            seconds = time.perf_counter() - started
            router_metrics = http.get("/metrics").text
    finally:
        server.should_exit = True
        thread.join(10)
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    estimated = next(float(line.split()[-1]) for line in router_metrics.splitlines()
                     if line.startswith("arbor_router_estimated_hit_rate "))
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    return {"policy": policy, "hit_rate": cached / prompt, "requests_per_s": len(jobs) / seconds,
            "output_tok_per_s": sum(m["completion_tokens"] for m in metas) / seconds, "seconds": seconds,
            "router_estimated_hit_rate": estimated, "loadavg_after": load_average()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--per-prompt", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=1536)
    parser.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    args = parser.parse_args()
    print(reproduce_line(), "| load average before:", load_average(), flush=True)
    rng = random.Random(0)
    jobs = [system_prompt(i) + f"question number {j}: what are your opening hours on day {j % 7}?"
            for i in range(args.prompts) for j in range(args.per_prompt)]
    rng.shuffle(jobs)
    results = []
    for policy in args.policies:
        r = run_policy(policy, args, jobs)
        results.append(r)
        print(json.dumps(r), flush=True)
    base = results[0]
    for r in results[1:]:
        print(f"{r['policy']} vs {base['policy']}: hit rate {r['hit_rate']:.1%} vs {base['hit_rate']:.1%}, "
              f"throughput {r['requests_per_s'] / base['requests_per_s']:.2f}x")
    save_result("bench_router_dp", {"args": vars(args), "results": results, "command": reproduce_line()})


if __name__ == "__main__":
    main()
