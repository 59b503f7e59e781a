"""Engine against engine: Arbor's server and llama.cpp's ``llama-server`` serving the same
GGUF, one server at a time, on ``bench_serving.py``'s natural workload.

What makes the comparison fair (and what a llama.cpp or vLLM maintainer would check):

- the same requests on every side: distinct natural text, prompts log-uniform in 64-1,024
  tokens, outputs log-uniform in 64-256 (``ignore_eos``), tokens counted from ``usage``,
  no logprobs (ITL per streamed chunk, TPOT per token from ``usage``);
- the same file, threads (2) and flash attention (``-fa on``) for llama-server, whose
  slot count ``-np N`` is chosen by a quick sweep (the best output tok/s of a burst);
- one server at a time, each started fresh for every cell (no cache carried over);
- Poisson arrivals at a rate sweep found from each side's saturation (a burst of
  requests sent at once: completed requests per second); rates are fractions of the
  geometric mean of the sides' saturation rates, so below, at and over capacity;
- sides alternated per rate and repeat (who goes first flips), repeats with their spread.

Output: one table per model (median and range over the repeats of output tok/s, TTFT
p50/p99, ITL p99, TPOT p50, end-to-end p50; failures) and a plot of output tok/s vs TTFT
p99 and ITL p99, one line per side. Saved as ``benchmarks/results/<name>.json`` and
``<name>.png``.

Build llama.cpp first (``benchmarks/peers/build_llama_cpp.sh``; it writes the env file),
then, e.g. the default model in Q4_0 on both sides::

    .venv/bin/python benchmarks/bench_serving_peers.py --model model.Q4_0.gguf \\
        --llama-env llama.cpp-build/llama.cpp.env \\
        --arbor arbor= --arbor "arbor-slo=--itl-slo 0.15 --ttft-slo 1" --np 4 8 16

Each ``--arbor NAME=FLAGS`` is a side: ``arbor serve`` with those extra flags (on top of
``--weights gguf --num-threads THREADS``). The machine this ran on is shared: read the spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as bs  # noqa: E402
from common import RESULTS, load_average, reproduce_line, save_result  # noqa: E402
from peer_llama import read_env  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Side:
    """A server to measure: its name in the tables and the command that starts it on a port."""

    name: str
    kind: str  # "arbor" or "llama"
    flags: tuple[str, ...] = ()  # extra command-line flags
    np: int | None = None  # llama-server's slot count

    def command(self, model: Path, port: int, llama_server: Path | None, ctx_per_slot: int,
                threads: int = 2) -> list[str]:
        """The server's command line; ``model`` a GGUF file (an HF directory: Arbor only)."""
        if self.kind == "arbor":
            weights = ["--weights", "gguf"] if model.suffix == ".gguf" else []
            return [sys.executable, "-m", "runtime.cli", "serve", "--model", str(model), *weights,
                    "--num-threads", str(threads), "--port", str(port), "--log-level", "warning", *self.flags]
        assert llama_server is not None and self.np is not None
        return [str(llama_server), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-np", str(self.np),
                "-c", str(self.np * ctx_per_slot), "-fa", "on", "--host", "127.0.0.1", "--port", str(port),
                *self.flags]


@dataclass
class Cell:
    """One side at one rate, one repeat."""

    side: str
    rate: float | None  # None: a burst (all requests at once)
    repeat: int
    summary: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process for one cell: started, waited for (``/health``), stopped."""

    def __init__(self, side: Side, args: argparse.Namespace, log_dir: Path) -> None:
        self.side, self.port = side, free_port()
        cmd = side.command(args.model, self.port, args.llama_server, args.ctx_per_slot, args.threads)
        self.log = open(log_dir / f"{side.name}.log", "ab")  # noqa: SIM115 (closed in stop)
        self.log.write(f"\n$ {shlex.join(cmd)}\n".encode())
        # NOTE: a process group, not a session: with the kernel's autogroup scheduling a new
        # session is a new group that weighs as much as any other, whatever nice the
        # benchmark runs at, so a server would share the cores with every other session
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     process_group=0, env=self.env(side, args))
        self.url = f"http://127.0.0.1:{self.port}"

    def env(self, side: Side, args: argparse.Namespace) -> dict[str, str]:
        env = dict(os.environ)
        if args.step_traces is not None and side.kind == "arbor":
            args.step_traces.mkdir(parents=True, exist_ok=True)
            env["ARBOR_STEP_TRACE"] = str(args.step_traces / f"{side.name}.{self.port}.jsonl")
        return env

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.side.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.side.name} not ready in {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> Server:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def measure(url: str, jobs: list[bs.Job], rate: float | None, warmup: str) -> dict[str, Any]:
    """Warm the server up (one request), then send ``jobs`` (Poisson at ``rate``; None: all
    at once) and summarize."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=url + "/v1", timeout=900, limits=limits) as http:
        model = (await http.get("/models")).json()["data"][0]["id"]
        client = bs.Client(http, model, ignore_eos=True, system="")
        await client.completion(bs.Job("warmup", warmup, 8))
        if rate is None:
            start = time.perf_counter()
            samples = await asyncio.gather(*(client.completion(j) for j in jobs))
            return bs.summarize(list(samples), time.perf_counter() - start)
        samples, seconds = await bs.run_jobs(client, jobs, 1, 0, rate)
        return bs.summarize(samples, seconds)


def run_cell(side: Side, args: argparse.Namespace, jobs: list[bs.Job], rate: float | None, repeat: int,
             warmup: str) -> Cell:
    with Server(side, args, args.log_dir) as server:
        summary = asyncio.run(measure(server.url, jobs, rate, warmup))
    cell = Cell(side.name, rate, repeat, summary)
    if args.cells_dir is not None:
        save_cell(args.cells_dir, side, cell)
    all_ = summary["buckets"].get("all", {})
    print(f"  {side.name:<16} rate {rate if rate is not None else 'burst':<6} rep {repeat}: "
          f"{summary['num_ok']}/{summary['num_requests']} ok, {summary['output_token_throughput']} tok/s, "
          f"{summary['request_throughput']} req/s, TTFT p50/p99 {get(all_, 'ttft_ms', 'p50')}/"
          f"{get(all_, 'ttft_ms', 'p99')} ms, ITL p99 {get(all_, 'itl_ms', 'p99')} ms "
          f"(load {load_average()})", flush=True)
    return cell


def cell_path(cells_dir: Path, side: str, rate: float | None, repeat: int) -> Path:
    return cells_dir / f"{side}@{'burst' if rate is None else f'{rate:g}'}#{repeat}.json"


def save_cell(cells_dir: Path, side: Side, cell: Cell) -> Path:
    """One cell as a file of its own, so a campaign split over several invocations (each
    short enough to hold a shared machine) merges into one table (``--merge``)."""
    cells_dir.mkdir(parents=True, exist_ok=True)
    path = cell_path(cells_dir, cell.side, cell.rate, cell.repeat)
    path.write_text(json.dumps({"side": side.__dict__, "cell": cell.__dict__, "load_average": load_average(),
                                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    return path


def load_cells(cells_dir: Path) -> tuple[list[Side], list[Cell], list[Cell]]:
    """The sides (first seen order: Arbor sides, then llama-server) and the rate cells and
    burst cells saved in ``cells_dir``."""
    sides: dict[str, Side] = {}
    rated: list[Cell] = []
    bursts: list[Cell] = []
    for path in sorted(cells_dir.glob("*.json")):
        data = json.loads(path.read_text())
        side = Side(**{**data["side"], "flags": tuple(data["side"]["flags"])})
        cell = Cell(**data["cell"])
        (bursts if cell.rate is None else rated).append(cell)
        if cell.rate is not None:
            sides.setdefault(side.name, side)
    ordered = sorted(sides.values(), key=lambda s: (s.kind != "arbor", s.name))
    return ordered, sorted(rated, key=lambda c: (c.rate or 0.0, c.repeat, c.side)), bursts


def trace_summary(traces: Path, sides: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per Arbor side, over its step traces (all its cells): step time percentiles, the
    slowest steps that had streams decoding (the ITL tail), and the cost model's median
    relative error one step ahead."""
    out: dict[str, dict[str, Any]] = {}
    for side in sides:
        steps = [json.loads(line) for path in sorted(traces.glob(f"{side}.*.jsonl"))
                 for line in path.read_text().splitlines() if line.strip()]
        if not steps:
            continue
        seconds = sorted(s["seconds"] for s in steps)
        errors = [abs(s["predicted"] - s["seconds"]) / s["seconds"] for s in steps if s.get("predicted")]
        slow = sorted((s for s in steps if s["decode_rows"] > 0), key=lambda s: -s["seconds"])[:5]
        out[side] = {"steps": len(steps), "p50 ms": round(1e3 * seconds[len(seconds) // 2], 1),
                     "p99 ms": round(1e3 * seconds[int(0.99 * (len(seconds) - 1))], 1),
                     "max ms": round(1e3 * seconds[-1], 1),
                     "median prediction error": round(statistics.median(errors), 3) if errors else None,
                     "slowest steps with decodes": slow}
    return out


def get(stats: dict[str, Any], metric: str, p: str) -> float | None:
    value = stats.get(metric, {}).get(p)
    return float(value) if value is not None else None


def jobs_for(args: argparse.Namespace, seed: int, num: int) -> list[bs.Job]:
    load = bs.Workload(tuple(args.prompt_tokens), tuple(args.output_tokens), 24, 400, 16, 96, 1, 0)
    text = bs.TextSource(args.tokenizer, seed)
    return bs.make_jobs(num, load, seed, ["natural"], text=text)


def choose_np(args: argparse.Namespace, jobs: list[bs.Job], warmup: str) -> tuple[Side, list[Cell]]:
    """llama-server's slot count: the best output tok/s of a burst over ``args.np`` (one
    given: that one, no burst)."""
    if len(args.np) == 1:
        return Side(f"llama-np{args.np[0]}", "llama", tuple(args.llama_flags), args.np[0]), []
    cells = [run_cell(Side(f"llama-np{n}", "llama", tuple(args.llama_flags), n), args, jobs, None, 0, warmup)
             for n in args.np]
    best = max(cells, key=lambda c: c.summary["output_token_throughput"])
    n = args.np[cells.index(best)]
    print(f"llama-server: -np {n} (best burst output tok/s of -np {args.np})")
    return Side(f"llama-np{n}", "llama", tuple(args.llama_flags), n), cells


def sweep_rates(saturation: dict[str, float], fractions: Sequence[float]) -> list[float]:
    """Rates at ``fractions`` of the geometric mean of the sides' saturation rates (req/s)."""
    center = math.exp(statistics.fmean(math.log(max(r, 1e-3)) for r in saturation.values()))
    return [round(f * center, 3) for f in fractions]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


FIGURES = {  # column -> (bucket metric, percentile) or a summary key
    "output tok/s": ("output_token_throughput", None),
    "TTFT p50 ms": ("ttft_ms", "p50"),
    "TTFT p99 ms": ("ttft_ms", "p99"),
    "ITL p99 ms": ("itl_ms", "p99"),
    "TPOT p50 ms": ("tpot_ms", "p50"),
    "E2E p50 ms": ("e2e_ms", "p50"),
}


def figure(cell: Cell, column: str) -> float | None:
    key, p = FIGURES[column]
    if p is None:
        return float(cell.summary[key])
    return get(cell.summary["buckets"].get("all", {}), key, p)


def table(cells: list[Cell], sides: list[str], rates: list[float]) -> list[dict[str, Any]]:
    """One row per (rate, side): each figure's median over the repeats, its range, failures."""
    rows = []
    for rate in rates:
        for side in sides:
            group = [c for c in cells if c.side == side and c.rate == rate]
            if not group:
                continue
            row: dict[str, Any] = {"rate req/s": rate, "side": side}
            for column in FIGURES:
                values = [v for c in group if (v := figure(c, column)) is not None]
                if values:
                    s = spread(values)
                    row[column] = (f"{s['median']:g}" if len(values) == 1
                                   else f"{s['median']:g} ({s['min']:g}-{s['max']:g})")
                    row["_" + column] = s
            row["failed"] = sum(c.summary["num_requests"] - c.summary["num_ok"] for c in group)
            row["repeats"] = len(group)
            rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], sides: list[str], path: Path, title: str) -> Path:
    """Output tok/s against TTFT p99 and ITL p99, one line per side (medians; bars: range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric in zip(axes, ("TTFT p99 ms", "ITL p99 ms"), strict=True):
        for side in sides:
            pts = [r for r in rows if r["side"] == side and "_" + metric in r]
            if not pts:
                continue
            x = [r["_output tok/s"]["median"] for r in pts]
            y = [r["_" + metric]["median"] for r in pts]
            yerr = [[v - r["_" + metric]["min"] for v, r in zip(y, pts, strict=True)],
                    [r["_" + metric]["max"] - v for v, r in zip(y, pts, strict=True)]]
            xerr = [[v - r["_output tok/s"]["min"] for v, r in zip(x, pts, strict=True)],
                    [r["_output tok/s"]["max"] - v for v, r in zip(x, pts, strict=True)]]
            ax.errorbar(x, y, yerr=yerr, xerr=xerr, marker="o", capsize=3, label=side)
            for r, xi, yi in zip(pts, x, y, strict=True):
                ax.annotate(f"{r['rate req/s']:g}/s", (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="output tokens/s", ylabel=metric, title=f"{metric} vs throughput")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_side(spec: str) -> Side:
    name, _, flags = spec.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"--arbor wants NAME=FLAGS, got {spec!r}")
    return Side(name, "arbor", tuple(shlex.split(flags)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True,
                   help="the GGUF file both sides serve (an HF directory: Arbor sides only)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.json (or a directory) prompts are cut with (default: the default model's)")
    p.add_argument("--arbor", type=parse_side, action="append", default=[], metavar="NAME=FLAGS",
                   help="an Arbor side: arbor serve with these extra flags (repeatable)")
    p.add_argument("--llama-env", type=Path, default=None, help="the env file build_llama_cpp.sh wrote")
    p.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (else from --llama-env)")
    p.add_argument("--llama-flags", default="", help="extra llama-server flags")
    p.add_argument("--np", type=int, nargs="+", default=[4, 8, 16],
                   help="llama-server slot counts to try (the best burst throughput is used)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every server")
    p.add_argument("--ctx-per-slot", type=int, default=1536, help="llama-server context per slot (-c = np x this)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=(64, 1024), metavar=("LO", "HI"))
    p.add_argument("--output-tokens", type=int, nargs=2, default=(64, 256), metavar=("LO", "HI"))
    p.add_argument("--num-requests", type=int, default=40, help="requests per cell")
    p.add_argument("--saturation-requests", type=int, default=24, help="requests of a saturation burst")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.6, 1.0, 1.5],
                   help="rates as fractions of the geometric mean of the sides' saturation rates")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="rates (req/s) to run instead of finding them from saturation")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="bench_serving_peers")
    p.add_argument("--title", default=None, help="the table's title (default: the GGUF's file name)")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/arbor-bench-serving-peers"))
    p.add_argument("--first-repeat", type=int, default=0,
                   help="number the repeats from here (a later invocation adds repeats with new requests)")
    p.add_argument("--only", nargs="+", default=None, metavar="SIDE",
                   help="run only these sides (by name; llama-server's is llama-npN)")
    p.add_argument("--cells-dir", type=Path, default=None,
                   help="save every cell there as a file of its own (to merge invocations)")
    p.add_argument("--saturation-only", action="store_true",
                   help="run the -np sweep and the saturation bursts, print the rates, stop")
    p.add_argument("--step-traces", type=Path, default=None,
                   help="Arbor servers write a step trace there (ARBOR_STEP_TRACE), a file per cell")
    p.add_argument("--note", action="append", default=[], help="a line added to the result's summary")
    p.add_argument("--merge", action="store_true",
                   help="run nothing: build the table, plot and result from the cells in --cells-dir")
    args = p.parse_args(argv)
    if (args.merge or args.saturation_only) and args.cells_dir is None:
        p.error("--merge and --saturation-only need --cells-dir")
    if args.llama_server is None and args.llama_env is not None:
        args.llama_server = Path(read_env(args.llama_env)["LLAMA_SERVER"])
    if not args.arbor:
        args.arbor = [Side("arbor", "arbor")]
    args.llama_flags = shlex.split(args.llama_flags)
    args.tokenizer = args.tokenizer or bs.default_tokenizer()
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    print(reproduce_line(), f"(load average {load_average()})", flush=True)
    if args.merge:
        sides, cells, bursts = load_cells(args.cells_dir)
        saturation = {c.side: c.summary["request_throughput"] for c in bursts}
        rates = sorted({c.rate for c in cells if c.rate is not None})
        np_cells = [c for c in bursts if c.side.startswith("llama")]
        return report(args, sides, cells, rates, saturation, np_cells, [c for c in bursts if c not in np_cells])
    args.log_dir.mkdir(parents=True, exist_ok=True)
    warmup = bs.TextSource(args.tokenizer, args.seed + 999).prompt(256)
    sides: list[Side] = list(args.arbor)
    np_cells: list[Cell] = []
    saturation: dict[str, float] = {}
    burst = jobs_for(args, args.seed, args.saturation_requests)
    if args.llama_server is not None:
        llama, np_cells = choose_np(args, burst, warmup)
        sides.append(llama)
        if np_cells:
            best = next(c for c in np_cells if c.side == llama.name)
            saturation[llama.name] = best.summary["request_throughput"]
    if args.only is not None:
        sides = [s for s in sides if s.name in args.only]
    rates = args.rates
    sat_cells = []
    if rates is None:
        for side in sides:
            if side.kind == "arbor":
                cell = run_cell(side, args, burst, None, 0, warmup)
                sat_cells.append(cell)
                saturation[side.name] = cell.summary["request_throughput"]
        rates = sweep_rates(saturation, args.fractions)
        print(f"saturation (req/s): {saturation}; rates: {rates}", flush=True)
    if args.saturation_only:
        return {"saturation": saturation, "rates": rates}
    cells: list[Cell] = []
    for i, rate in enumerate(rates):
        for repeat in range(args.first_repeat, args.first_repeat + args.repeats):
            # NOTE: a repeat's requests depend on the repeat only, so a campaign split by
            # rate or repeat over several invocations sends the same requests
            jobs = jobs_for(args, args.seed + 1 + repeat, args.num_requests)
            order = sides if (i + repeat) % 2 == 0 else sides[::-1]  # NOTE: who goes first alternates
            cells += [run_cell(side, args, jobs, rate, repeat, warmup) for side in order]
    return report(args, sides, cells, rates, saturation, np_cells, sat_cells)


def report(args: argparse.Namespace, sides: list[Side], cells: list[Cell], rates: list[float],
           saturation: dict[str, float], np_cells: list[Cell], sat_cells: list[Cell]) -> dict[str, Any]:
    """The table (printed), the plot and the saved result."""
    names = [s.name for s in sides]
    rows = table(cells, names, rates)
    title = args.title or args.model.name
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = plot(rows, names, RESULTS / f"{args.name}.png", f"{title}: output tok/s vs latency p99")
    print_table(title, rows)
    repeats = sorted({c.repeat for c in cells})
    requests = sorted({c.summary["num_requests"] for c in cells})
    payload: dict[str, Any] = {
        "title": f"Serving, engine against engine: {title}",
        "summary": [f"sides: {', '.join(f'{s.name} ({shlex.join(s.flags) or s.kind})' for s in sides)}",
                    (f"saturation bursts ({args.saturation_requests} requests), req/s: {saturation}" if saturation
                     else "rates given (no saturation bursts)"),
                    f"{'/'.join(map(str, requests))} requests a cell, {len(repeats)} repeats, sides alternated; "
                    f"{args.threads} threads a server; "
                    f"prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, outputs "
                    f"{args.output_tokens[0]}-{args.output_tokens[1]} (log-uniform, ignore_eos); "
                    "median (min-max) over repeats; a shared 2-core machine", *args.note],
        "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
        "plots": [png.name],
        "sides": [s.__dict__ for s in sides], "saturation": saturation, "rates": rates,
        "np_sweep": [{"side": c.side, "summary": c.summary} for c in np_cells],
        "saturation_cells": [{"side": c.side, "summary": c.summary} for c in sat_cells],
        "cells": [c.__dict__ for c in cells], "model": str(args.model),
    }
    if args.step_traces is not None and args.step_traces.is_dir():
        steps = trace_summary(args.step_traces, names)
        payload["step_traces"] = steps
        payload["summary"] += [
            f"step trace, {side}: {t['steps']} steps, p50/p99/max {t['p50 ms']}/{t['p99 ms']}/{t['max ms']} ms; "
            f"cost model median error {t['median prediction error']}; slowest with decodes: "
            + ", ".join(f"{s['prefill_tokens']} prompt tok + {s['decode_rows']} decodes {1e3 * s['seconds']:.0f} ms"
                        for s in t["slowest steps with decodes"][:3])
            for side, t in steps.items()]
    print(f"saved {save_result(args.name, payload)} and {png}")
    return payload


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    columns = ["rate req/s", "side", *FIGURES, "failed"]
    print(f"\n== {title}")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "-")) for c in columns) + " |")


if __name__ == "__main__":
    # NOTE: servers run in sessions of their own; SIGTERM as an exception runs Server.stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
