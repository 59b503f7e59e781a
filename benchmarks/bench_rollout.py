"""A full rollout plan (5% -> 25% -> 50% -> 100%) through the router under a mixed load,
with a good candidate, then with a bad one.

Three ``arbor serve`` workers on the default model (one torch thread each): the baseline
(fp32 KV), a good candidate (int8 KV: a real config change), and a bad candidate (the
baseline's config with the ``--fault-delay-ms`` test hook: every generation waits). For
each candidate a router (in this process) runs the plan with gates on the error rate,
the TTFT p99 ratio and the shadow KL, shadowing a share of the baseline's greedy
``/generate`` requests; ``--concurrency`` clients send a mix of whole and streamed
``/generate`` requests and OpenAI chat requests, each from one of 200 sticky sessions,
until the rollout completes or rolls back. Prints the per-pool table (p50/p99 TTFT, ITL,
end-to-end, errors), the shadow figures (exact match, KL, first divergence), the
timeline of events, and saves the JSON and a plot of the share and the gated metrics
over time under ``benchmarks/results/``.

    .venv/bin/python benchmarks/bench_rollout.py [--dwell 10] [--min-samples 4] [--fault-delay-ms 4000]
"""

from __future__ import annotations

import argparse
import json
import random
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
from common import RESULTS, load_average, reproduce_line, save_result  # noqa: E402

from runtime.router.app import create_router_app  # noqa: E402
from runtime.router.config import HealthConfig  # noqa: E402
from runtime.router.launch import free_port  # noqa: E402
from runtime.router.pools import Pools  # noqa: E402
from runtime.router.rollout_plan import plan_from_dict  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = ["Name a colour.", "What is 2 + 3?", "Say hello in French.", "Name a planet.",
             "What do bees make?", "Give a synonym of quick.", "Name a fruit.", "What is the opposite of hot?"]


def start_worker(flags: list[str], port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--port", str(port), "--num-threads", "1",
                             "--max-model-len", "1024", "--num-pages", "1024", "--log-level", "warning", *flags],
                            cwd=REPO)


def wait_healthy(urls: list[str], procs: list[subprocess.Popen[bytes]], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    for url, proc in zip(urls, procs, strict=True):
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"worker {url} exited while starting")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"worker {url} did not start")
            time.sleep(0.5)


def plan(args: argparse.Namespace) -> dict[str, Any]:
    steps = [{"weight": w, "dwell_s": args.dwell} for w in (5, 25, 50)] + [{"weight": 100}]
    return {"baseline": "baseline", "candidate": "candidate", "steps": steps, "interval_s": 0.5,
            "window_s": 60, "min_samples": args.min_samples, "sticky": ["session", "prompt"],
            "gates": [{"metric": "error_rate", "max": 0.02},
                      {"metric": "ttft_p99_ratio", "max": args.max_ttft_ratio},
                      {"metric": "shadow_mean_kl", "max": args.max_kl, "min_samples": 3}],
            "shadow": {"share": args.shadow_share, "queue_cap": 16, "max_user_inflight": 8}}


def one_request(url: str, rng: random.Random) -> tuple[int, str]:
    session = f"user-{rng.randrange(200)}"
    question = rng.choice(QUESTIONS)
    kind = rng.choices(["generate", "stream", "chat"], weights=[6, 3, 1])[0]
    headers = {"x-session-id": session}
    if kind == "chat":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": question}], "max_tokens": 4,
                                "temperature": 0}
        resp = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
        return resp.status_code, kind
    body = {"text": f"Q: {question}\nA:", "stream": kind == "stream",
            "sampling_params": {"max_new_tokens": 8 if kind == "stream" else 4, "temperature": 0.0,
                                "top_logprobs": 5}}
    resp = httpx.post(url + "/generate", json=body, headers=headers, timeout=300)
    failed = kind == "stream" and '"error"' in resp.text
    return (503 if failed else resp.status_code), kind


def run_scenario(name: str, base_url: str, cand_url: str, args: argparse.Namespace) -> dict[str, Any]:
    pools, urls = Pools.parse([f"baseline={base_url}", f"candidate={cand_url}"])
    app = create_router_app(urls, health=HealthConfig(interval_s=0.5, timeout_s=5, failures_to_remove=3),
                            pools=pools, plan=plan_from_dict(plan(args), pools.names, digest=name))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    timeline: list[dict[str, Any]] = []
    statuses: list[int] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            st = httpx.get(url + "/rollout", timeout=10).json()
            gates = {g["metric"]: g["value"] for g in st["gates"]}
            gates |= {g["metric"] + ":verdict": g["verdict"] for g in st["gates"]}
            timeline.append({"t": time.monotonic() - t0, "weight": st["weights"].get("candidate", 0),
                             "state": st["state"], **gates})
            if st["state"] in ("completed", "rolled_back"):
                stop.set()
            time.sleep(0.5)

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set() and time.monotonic() - t0 < args.max_s:
            statuses.append(one_request(url, rng)[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(client, range(args.concurrency)))
    stop.set()
    sampler.join()
    status = httpx.get(url + "/rollout", timeout=10).json()
    server.should_exit = True
    thread.join(10)
    gates = [{"metric": g["metric"], "bound": g.get("max", g.get("min"))} for g in plan(args)["gates"]]
    return {"name": name, "candidate": cand_url, "gates": gates, "seconds": time.monotonic() - t0, "requests": len(statuses),
            "failed_user_requests": sum(s >= 500 for s in statuses), "final": status["state"],
            "panel": status["panel"], "shadow": status["shadow"], "events": status["events"], "timeline": timeline}


def print_report(r: dict[str, Any]) -> None:
    print(f"\n== {r['name']} candidate: {r['final']} after {r['seconds']:.0f} s, {r['requests']} user requests, "
          f"{r['failed_user_requests']} failed")
    print(f"{'pool':10} {'requests':>8} {'errors':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'e2e p50':>8} {'e2e p99':>8}   versions")
    for pool, row in r["panel"].items():
        cells = []
        for metric in ("ttft_s", "itl_s", "e2e_s"):
            for q in ("p50", "p99"):
                v = row[metric][q]
                cells.append("n/a" if v is None else f"{v * 1e3:.0f}ms")
        print(f"{pool:10} {row['requests']:>8} {row['errors']:>6} " + " ".join(f"{c:>8}" for c in cells)
              + f"   {', '.join(row['versions'])}")
    sh = r["shadow"]
    fmt = lambda v: "n/a" if v is None else f"{v:.4g}"  # noqa: E731
    print(f"shadow: {sh['pairs']} pairs, exact match {fmt(sh['exact_match'])}, mean KL {fmt(sh['mean_kl'])} "
          f"({sh['kl_pairs']} pairs), tokens before first divergence {fmt(sh['prefix_share'])}, "
          f"length ratio {fmt(sh['length_ratio'])}, jobs {sh['jobs']}")
    t_start = r["events"][0]["t"]
    for e in r["events"]:
        detail = e["detail"].get("why", "") if e["detail"] else ""
        print(f"  t={e['t'] - t_start:6.1f}s {e['kind']:9} step {e['step'] + 1} -> {e['weight']:3d}% {detail}")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 6), sharex="col", squeeze=False)
    for col, r in enumerate(results):
        t = [p["t"] for p in r["timeline"]]
        axes[0][col].step(t, [p["weight"] for p in r["timeline"]], where="post")
        axes[0][col].set_title(f"{r['name']} candidate: {r['final']}")
        axes[0][col].set_ylabel("candidate share, %")
        for metric in ("ttft_p99_ratio", "error_rate", "shadow_mean_kl"):
            values = [p.get(metric) if p.get(metric) is not None else float("nan") for p in r["timeline"]]
            line, = axes[1][col].plot(t, values, label=metric, linestyle=":", alpha=0.5)
            # NOTE: solid markers where the gate decided; the dotted line alone: too few samples (wait)
            decided = [v if p.get(metric + ":verdict") in ("pass", "fail") else float("nan")
                       for v, p in zip(values, r["timeline"], strict=True)]
            axes[1][col].plot(t, decided, marker=".", linestyle="", color=line.get_color())
        for gate in r.get("gates", []):
            axes[1][col].axhline(gate["bound"], linestyle="--", linewidth=0.8, color="grey")
        axes[1][col].set_ylabel("gated metric (current step)")
        axes[1][col].set_xlabel("seconds")
        axes[1][col].legend()
    fig.tight_layout()
    fig.savefig(path)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The page-level view of a run (docs/benchmarks.md): a row per candidate and pool."""
    rows = []
    for run in results:
        for pool, figures in run["panel"].items():
            ttft = figures["ttft_s"]
            rows.append({"candidate": run["name"], "outcome": run["final"], "seconds": round(run["seconds"], 1),
                         "pool": pool, "requests": figures["requests"], "errors": figures["errors"],
                         "failed user requests": run["failed_user_requests"],
                         "TTFT p50 ms": _ms(ttft["p50"]), "TTFT p99 ms": _ms(ttft["p99"]),
                         "shadow exact match": run["shadow"].get("exact_match") if pool == "candidate" else None,
                         "shadow mean KL": run["shadow"].get("mean_kl") if pool == "candidate" else None})
    return {"title": "Rollout through the router: a good candidate promoted, a bad one rolled back",
            "rows": rows, "plots": ["bench_rollout.png"]}


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(1000 * seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dwell", type=float, default=10.0, help="seconds per step (at least)")
    parser.add_argument("--min-samples", type=int, default=4)
    parser.add_argument("--max-ttft-ratio", type=float, default=2.0)
    parser.add_argument("--max-kl", type=float, default=0.5)
    parser.add_argument("--shadow-share", type=float, default=0.25)
    parser.add_argument("--fault-delay-ms", type=float, default=4000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-s", type=float, default=200, help="per scenario, at most")
    args = parser.parse_args()
    print(reproduce_line())
    print(f"load average before: {load_average()} (a shared machine: figures are noisy)")
    configs = {"baseline": [], "good": ["--kv-cache-dtype", "int8"], "bad": ["--fault-delay-ms", str(args.fault_delay_ms)]}
    ports = {name: free_port() for name in configs}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    procs = {name: start_worker(flags, ports[name]) for name, flags in configs.items()}
    try:
        wait_healthy(list(urls.values()), list(procs.values()))
        results = [run_scenario(name, urls["baseline"], urls[name], args) for name in ("good", "bad")]
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)
    for r in results:
        print_report(r)
    png = RESULTS / "bench_rollout.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(results, png)
    out = save_result("bench_rollout", summarize(results) | {"args": vars(args), "results": results})
    print(f"\nsaved {out} and {png}")
    print(json.dumps({r["name"]: {"final": r["final"], "seconds": round(r["seconds"], 1),
                                  "failed_user_requests": r["failed_user_requests"]} for r in results}))


if __name__ == "__main__":
    main()
