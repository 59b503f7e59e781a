"""Soak with faults: a mixed load against a real ``arbor serve`` on 127.0.0.1 for N minutes.

The load (random, seeded): chat and completions (plain and streamed), native streams,
programs with forks, programs whose tool calls raise or outlast their deadline,
JSON-schema-constrained requests, broken schemas, oversized prompts, clients that
disconnect mid-stream, requests the client aborts, bursts above the server's capacity
(so 429/503 answers come back), and unknown models. Bounded in time (``--minutes``) and
in count (``--max-requests``).

Every request ends in one class:

  completed       a 2xx answer, whole (a stream reached ``[DONE]`` with its final event)
  failed_clear    a 4xx/429/503 with an error message, a 504 for the deadline the soak
                  asked for, or a stream whose last event is an error with a message
  client_gone     the soak itself disconnected or aborted it (on purpose)
  lost            anything else: a 5xx, a dropped connection, a malformed answer, no answer

Reported: requests sent / completed / failed_clear / client_gone / lost (must be 0), per
kind; KV pages still used once the server is idle (must be 0); the server's RSS at the
start (after a warm-up window) and at the end; p50/p99 latency of completed requests per
window. The server's RSS is also sampled every ``--rss-every`` seconds from start-up to the end
(warm-up included) into ``benchmarks/results/<name>_rss.csv`` and a plot ``<name>_rss.png``;
the summary gives RSS at the start of the soak, at 10 and 30 minutes, and whether the last
``--plateau-minutes`` stay within ±5% of their mean. Saves ``benchmarks/results/<name>.json``;
exits 1 if anything was lost or leaked.

    .venv/bin/python benchmarks/soak.py --minutes 10 [--model default] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, load_average, reproduce_line, save_result, start_arbor_server  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "soak_programs.py"
WORDS = ["river", "stone", "cloud", "paper", "garden", "silver", "window", "orange", "music", "forest", "letter", "bridge"]
MODEL = "soak"
RETRY_BACKOFF_S = 1.0
LIMITS = {"--max-inflight": 24, "--max-waiting": 48, "--max-tokens-limit": 64, "--max-prompt-tokens": 300,
          "--request-timeout": 60, "--tenant-max-concurrent": 16, "--max-body-bytes": 256 * 1024}


@dataclass
class Outcome:
    kind: str
    klass: str  # completed | failed_clear | client_gone | lost
    latency: float
    ended_at: float
    detail: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    lost_examples: list[str] = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        self.outcomes.append(o)
        if o.klass == "lost" and len(self.lost_examples) < 20:
            self.lost_examples.append(f"{o.kind}: {o.detail[:300]}")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


# ---- one request of each kind: returns (class, detail) --------------------------------------

def classify_plain(r: httpx.Response, deadline_asked: bool = False) -> tuple[str, str]:
    if 200 <= r.status_code < 300:
        return "completed", ""
    try:
        message = r.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - no JSON error body: that itself is the finding
        return "lost", f"{r.status_code} without an error body: {r.text[:200]}"
    if r.status_code < 500 or r.status_code == 503 or (r.status_code == 504 and deadline_asked):
        return ("failed_clear", f"{r.status_code} {message[:80]}") if message else ("lost", "empty message")
    return "lost", f"{r.status_code}: {message}"


async def read_stream(r: httpx.Response, stop_after: int | None = None) -> tuple[str, str]:
    """Read SSE events; ``stop_after``: disconnect after that many (client_gone)."""
    if r.status_code != 200:
        await r.aread()
        return classify_plain(r)
    events = 0
    last: dict[str, Any] | None = None
    async for line in r.aiter_lines():
        if line == "data: [DONE]":
            if last is not None and "error" in last:
                err = last["error"]
                ok = err.get("message") and (err.get("code", 500) < 500 or err.get("type") in ("timeout", "service_unavailable"))
                return ("failed_clear", err["message"][:80]) if ok else ("lost", f"in-band {err}")
            return "completed", ""
        if line.startswith("data: "):
            last = json.loads(line[6:])
            events += 1
            if stop_after is not None and events >= stop_after:
                return "client_gone", "disconnected mid-stream"
    return "lost", f"stream ended without [DONE] after {events} events"


class Load:
    def __init__(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        self.http = http
        self.rng = rng

    def headers(self) -> dict[str, str]:
        return {"X-Tenant": self.rng.choice(["alpha", "beta", "gamma"]),
                "X-Priority": self.rng.choice(["interactive", "interactive", "batch"])}

    async def chat(self) -> tuple[str, str]:
        body = {"model": MODEL, "max_tokens": self.rng.randint(1, 24), "temperature": 0.7,
                "messages": [{"role": "user", "content": words(self.rng, 12)}]}
        return classify_plain(await self.http.post("/v1/chat/completions", json=body, headers=self.headers()))

    async def chat_stream(self) -> tuple[str, str]:
        body = {"model": MODEL, "max_tokens": self.rng.randint(1, 32), "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": words(self.rng, 20)}]}
        async with self.http.stream("POST", "/v1/chat/completions", json=body, headers=self.headers()) as r:
            return await read_stream(r)

    async def completion(self) -> tuple[str, str]:
        body = {"model": MODEL, "prompt": words(self.rng, 30), "max_tokens": 16, "n": self.rng.randint(1, 3)}
        return classify_plain(await self.http.post("/v1/completions", json=body, headers=self.headers()))

    async def generate_stream(self) -> tuple[str, str]:
        body = {"text": words(self.rng, 40), "stream": True,
                "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
        async with self.http.stream("POST", "/generate", json=body, headers=self.headers()) as r:
            return await read_stream(r)

    async def disconnect(self) -> tuple[str, str]:
        body = {"text": words(self.rng, 20), "stream": True,
                "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
        async with self.http.stream("POST", "/generate", json=body, headers=self.headers()) as r:
            return await read_stream(r, stop_after=self.rng.randint(1, 4))

    async def abort(self) -> tuple[str, str]:
        body = {"text": words(self.rng, 20), "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
        try:
            r = await asyncio.wait_for(self.http.post("/generate", json=body), self.rng.uniform(0.05, 0.5))
        except TimeoutError:
            return "client_gone", "aborted by the client"
        return classify_plain(r)

    async def program_fork(self) -> tuple[str, str]:
        body = {"arguments": {"question": words(self.rng, 6), "n": self.rng.randint(1, 4)}}
        return classify_plain(await self.http.post("/programs/vote", json=body, headers=self.headers()))

    async def program_tools(self) -> tuple[str, str]:
        body = {"arguments": {"task": words(self.rng, 6), "rounds": self.rng.randint(1, 5)},
                "timeout": self.rng.choice([1.0, 5.0, 20.0])}
        r = await self.http.post("/programs/agent", json=body, headers=self.headers())
        return classify_plain(r, deadline_asked=True)

    async def constrained(self) -> tuple[str, str]:
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "n": {"type": "integer"}},
                  "required": ["city", "n"], "additionalProperties": False}
        body = {"model": MODEL, "max_tokens": 48, "messages": [{"role": "user", "content": "A city?"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
        return classify_plain(await self.http.post("/v1/chat/completions", json=body, headers=self.headers()))

    async def bad_schema(self) -> tuple[str, str]:
        schema = self.rng.choice([{"type": "nonsense"}, {"$ref": "#/nowhere"}, {"type": "string", "pattern": "a(b"}])
        body = {"text": "x", "sampling_params": {"max_new_tokens": 4, "constraint": {"json_schema": schema}}}
        return classify_plain(await self.http.post("/generate", json=body))

    async def oversized(self) -> tuple[str, str]:
        if self.rng.random() < 0.5:  # over the prompt-token limit
            return classify_plain(await self.http.post("/v1/completions", json={
                "model": MODEL, "prompt": words(self.rng, 600), "max_tokens": 4}))
        return classify_plain(await self.http.post("/generate", json={"text": "x" * 300_000}))  # over the body limit

    async def unknown_model(self) -> tuple[str, str]:
        return classify_plain(await self.http.post("/v1/completions", json={
            "model": "gpt-unknown", "prompt": "hi", "max_tokens": 2}))

    def kinds(self) -> dict[str, tuple[float, Callable[[], Awaitable[tuple[str, str]]]]]:
        return {"chat": (3, self.chat), "chat_stream": (3, self.chat_stream), "completion": (2, self.completion),
                "generate_stream": (2, self.generate_stream), "disconnect": (1.5, self.disconnect),
                "abort": (1, self.abort), "program_fork": (1.5, self.program_fork),
                "program_tools": (1, self.program_tools), "constrained": (1.5, self.constrained),
                "bad_schema": (0.7, self.bad_schema), "oversized": (0.7, self.oversized),
                "unknown_model": (0.3, self.unknown_model)}


async def one(load: Load, kind: str, fn: Callable[[], Awaitable[tuple[str, str]]], tally: Tally) -> None:
    start = time.monotonic()
    try:
        klass, detail = await fn()
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        klass, detail = "lost", f"{type(exc).__name__}: {exc}"
    now = time.monotonic()
    tally.add(Outcome(kind, klass, now - start, now, detail))
    if detail.startswith(("429", "503")):  # a client that honours Retry-After: this slot backs off
        await asyncio.sleep(RETRY_BACKOFF_S)


# ---- the run -------------------------------------------------------------------------------

def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    return start_arbor_server(["--model", model, "--programs", str(PROGRAMS), "--served-model-name", MODEL,
                               "--log-level", "warning", *[str(x) for kv in LIMITS.items() for x in kv], *extra])


async def drive(url: str, args: argparse.Namespace, server_pid: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    proc = psutil.Process(server_pid)
    tally = Tally()
    windows: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=args.concurrency + args.burst + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        load = Load(http, rng)
        kinds = load.kinds()
        names, weights = list(kinds), [w for w, _ in kinds.values()]
        start = time.monotonic()
        end = start + args.minutes * 60
        sent = 0
        inflight: set[asyncio.Task[None]] = set()
        next_burst = start + args.burst_every
        next_window = start + args.window
        window_start = start
        while time.monotonic() < end and sent < args.max_requests:
            while len(inflight) < args.concurrency and sent < args.max_requests:
                kind = rng.choices(names, weights)[0]
                inflight.add(asyncio.ensure_future(one(load, kind, kinds[kind][1], tally)))
                sent += 1
            if time.monotonic() >= next_burst:  # above capacity at once: 429/503 expected
                for _ in range(args.burst):
                    inflight.add(asyncio.ensure_future(one(load, "burst", load.chat, tally)))
                    sent += 1
                next_burst += args.burst_every
            done, inflight = await asyncio.wait(inflight, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
            inflight = set(inflight)
            if time.monotonic() >= next_window:
                windows.append(window_row(tally, window_start, time.monotonic(), start, proc, url))
                print(format_window(windows[-1]), flush=True)
                window_start, next_window = time.monotonic(), next_window + args.window
        if inflight:
            await asyncio.wait(inflight, timeout=180)
        windows.append(window_row(tally, window_start, time.monotonic(), start, proc, url))
        print(format_window(windows[-1]), flush=True)
        idle = await wait_idle(http, 120)
        metrics = (await http.get("/engine_metrics")).json()
    return {"tally": tally, "windows": windows, "sent": sent, "idle": idle, "engine": metrics,
            "rss_end": proc.memory_info().rss}


def window_row(tally: Tally, since: float, until: float, start: float, proc: psutil.Process,
               url: str) -> dict[str, Any]:
    done = [o.latency for o in tally.outcomes if o.klass == "completed" and since <= o.ended_at < until]
    ended = [o for o in tally.outcomes if since <= o.ended_at < until]
    metrics = httpx.get(url + "/engine_metrics", timeout=10).json()
    return {"t_s": round(until - start), "ended": len(ended), "completed": len(done),
            "p50_s": percentile(done, 50), "p99_s": percentile(done, 99),
            "rss_mb": proc.memory_info().rss / 2**20, "kv_pages_used": metrics["kv_pages_used"],
            "lost": sum(o.klass == "lost" for o in ended)}


def format_window(w: dict[str, Any]) -> str:
    return (f"t={w['t_s']:5d}s ended {w['ended']:4d} completed {w['completed']:4d} lost {w['lost']} "
            f"p50 {w['p50_s']:6.2f}s p99 {w['p99_s']:6.2f}s rss {w['rss_mb']:7.1f} MiB "
            f"kv_used {w['kv_pages_used']:.0f}")


async def wait_idle(http: httpx.AsyncClient, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = (await http.get("/engine_metrics")).json()
        if m["num_running"] == 0 and m["num_waiting"] == 0 and m["kv_pages_used"] == 0:
            return True
        await asyncio.sleep(0.5)
    return False


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(result: dict[str, Any], rss_start: int) -> dict[str, Any]:
    tally: Tally = result["tally"]
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    for o in tally.outcomes:
        by_kind[o.kind][o.klass] += 1
        by_kind["ALL"][o.klass] += 1
    return {
        "sent": result["sent"], "answered": len(tally.outcomes),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "lost": by_kind["ALL"]["lost"] + (result["sent"] - len(tally.outcomes)),
        "lost_examples": tally.lost_examples,
        "kv_pages_leaked": result["engine"]["kv_pages_used"], "idle": result["idle"],
        "rss_start_mb": rss_start / 2**20, "rss_end_mb": result["rss_end"] / 2**20,
        "rss_growth": result["rss_end"] / rss_start - 1.0, "windows": result["windows"],
    }


def print_table(s: dict[str, Any]) -> None:
    print(f"\n{'kind':16s} {'sent':>6s} {'completed':>9s} {'failed_clear':>12s} {'client_gone':>11s} {'lost':>5s}")
    for kind, c in s["by_kind"].items():
        print(f"{kind:16s} {sum(c.values()):6d} {c.get('completed', 0):9d} {c.get('failed_clear', 0):12d} "
              f"{c.get('client_gone', 0):11d} {c.get('lost', 0):5d}")
    print(f"\nsent {s['sent']}  lost {s['lost']}  KV pages used after idle {s['kv_pages_leaked']:.0f}  "
          f"RSS {s['rss_start_mb']:.1f} -> {s['rss_end_mb']:.1f} MiB ({s['rss_growth'] * 100:+.1f}%)")
    for example in s["lost_examples"]:
        print("  lost:", example)
    rss = s.get("rss") or {}
    if rss:
        print(f"RSS soak start {rss['rss_soak_start_mb']:.1f} MiB, 10 min {rss['rss_10min_mb']}, "
              f"30 min {rss['rss_30min_mb']}; last {rss['plateau_minutes']:g} min within "
              f"{rss['plateau_max_deviation'] * 100:.1f}% of {rss['plateau_mean_mb']:.1f} MiB "
              f"({'plateau' if rss['plateau_ok'] else 'NOT flat'})")


class RssSampler:
    """Samples one process's RSS every ``every`` seconds on a thread: (seconds since start, MiB, phase)."""

    def __init__(self, pid: int, every: float) -> None:
        self.proc = psutil.Process(pid)
        self.every = every
        self.phase = "warm-up"
        self.samples: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.every):
                return

    def sample(self) -> None:
        try:
            rss = self.proc.memory_info().rss / 2**20
        except psutil.Error:
            return
        self.samples.append((time.monotonic() - self._start, rss, self.phase))


def rss_figures(samples: list[tuple[float, float, str]], plateau_minutes: float) -> dict[str, Any]:
    """RSS at the soak's start, 10 and 30 minutes in (the nearest sample), and the plateau check.

    ``plateau_ok``: every sample of the last ``plateau_minutes`` is within ±5% of their mean.
    """
    soak = [(t, rss) for t, rss, phase in samples if phase == "soak"]
    if not soak:
        return {}
    t0 = soak[0][0]

    def at(minutes: float) -> float | None:
        if soak[-1][0] - t0 < minutes * 60 - 15:
            return None
        return min(soak, key=lambda s: abs(s[0] - t0 - minutes * 60))[1]

    tail = [rss for t, rss in soak if t >= soak[-1][0] - plateau_minutes * 60]
    mean = sum(tail) / len(tail)
    deviation = max(abs(r - mean) for r in tail) / mean
    return {"rss_soak_start_mb": soak[0][1], "rss_10min_mb": at(10), "rss_30min_mb": at(30),
            "rss_end_sample_mb": soak[-1][1], "plateau_minutes": plateau_minutes,
            "plateau_mean_mb": mean, "plateau_max_deviation": deviation, "plateau_ok": deviation <= 0.05}


def save_rss(name: str, samples: list[tuple[float, float, str]]) -> list[Path]:
    """Write ``<name>_rss.csv`` and, where matplotlib is installed, ``<name>_rss.png``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    csv_path = RESULTS / f"{name}_rss.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "rss_mib", "phase"])
        writer.writerows((round(t, 1), round(rss, 1), phase) for t, rss, phase in samples)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [csv_path]
    fig, ax = plt.subplots(figsize=(8, 4))
    for phase, colour in (("warm-up", "tab:gray"), ("soak", "tab:blue"), ("drain", "tab:green")):
        points = [(t / 60, rss) for t, rss, p in samples if p == phase]
        if points:
            ax.plot(*zip(*points, strict=True), ".-", color=colour, label=phase, markersize=3)
    ax.set_xlabel("minutes since the server answered /health")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title(f"{name}: arbor serve RSS under a mixed load")
    ax.grid(alpha=0.3)
    ax.legend()
    png_path = RESULTS / f"{name}_rss.png"
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return [csv_path, png_path]


def run(args: argparse.Namespace) -> dict[str, Any]:
    proc, url = start_server(args.model, args.server_args)
    try:
        with RssSampler(proc.pid, args.rss_every) as sampler:
            warm = argparse.Namespace(**{**vars(args), "minutes": args.warmup / 60, "max_requests": 10**9})
            print("warm-up:", flush=True)
            warmed = asyncio.run(drive(url, warm, proc.pid))  # NOTE: the first window grows RSS (allocator, caches)
            for example in warmed["tally"].lost_examples:
                print("  lost in the warm-up:", example, flush=True)
            print("soak:", flush=True)
            sampler.phase = "soak"
            sampler.sample()
            rss_start = psutil.Process(proc.pid).memory_info().rss
            result = asyncio.run(drive(url, args, proc.pid))
            sampler.phase = "drain"
            sampler.sample()
    finally:
        proc.terminate()
        code = proc.wait(60)
    summary = summarize(result, rss_start)
    summary["server_exit_status"] = code
    summary["rss"] = rss_figures(sampler.samples, args.plateau_minutes)
    summary["rss_files"] = [str(p) for p in save_rss(args.name, sampler.samples)]
    return summary


def ok(summary: dict[str, Any]) -> bool:
    """Nothing lost, no KV page held once idle, a clean exit of the server."""
    return summary["lost"] == 0 and summary["kv_pages_leaked"] == 0 and summary["server_exit_status"] == 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--model", default="default")
    p.add_argument("--concurrency", type=int, default=8, help="requests kept in flight")
    p.add_argument("--burst", type=int, default=40, help="extra requests sent at once every --burst-every s")
    p.add_argument("--burst-every", type=float, default=30.0)
    p.add_argument("--window", type=float, default=30.0, help="seconds per row of the latency table")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of load before RSS is taken")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-every", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--plateau-minutes", type=float, default=20.0,
                   help="the closing span whose RSS must stay within ±5%% of its mean")
    p.add_argument("--name", default="soak")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="passed to arbor serve (engine settings), e.g. --num-threads 1")
    return p.parse_args(argv)


def soak(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the tables, save the JSON; returns the summary."""
    args = parse_args(argv)
    print(reproduce_line(), f"load average {load_average()}", flush=True)
    summary = run(args)
    print_table(summary)
    summary["command"] = reproduce_line()
    print(f"saved {save_result(args.name, {**summary, 'args': vars(args)})}  load average {load_average()}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if ok(soak()) else 1)
