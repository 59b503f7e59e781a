"""Overload measured from outside: guidellm's rate sweep against ``arbor serve``, then a
constant rate past saturation.

guidellm (the ``overload`` extra: ``pip install -e '.[overload]'``, or ``pip install
--no-deps guidellm`` plus its non-torch dependencies so torch stays as it is) drives the
server's OpenAI chat endpoint with synthetic prompts of a fixed length, streaming:

1. ``--profile sweep``: one synchronous run (the baseline: one request at a time), one
   throughput run (everything at once: the saturation rate), then constant rates evenly
   between the two. Up to saturation there must be no errors.
2. A constant rate at ``--past`` x the measured saturation rate: what the server cannot
   take must be refused (429 with ``Retry-After``, counted from the server's own
   ``arbor_requests_total`` by status), and every admitted request must complete.
   Meanwhile a probe sends one request every 2 s and records the status and
   ``Retry-After`` it gets.

Per run: requests/s, output tokens/s, TTFT and ITL p50/p99 of completed requests, and the
completed / errored / incomplete counts; for every run, the server's answers by status.
Saves ``benchmarks/results/<name>.json`` and guidellm's own reports under
``benchmarks/results/guidellm/`` (``<name>_sweep.json``, ``<name>_past.json``; per-request
records dropped).

    .venv/bin/python benchmarks/bench_overload.py --seconds 30 --sweep-size 5
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, load_average, reproduce_line, save_result, start_arbor_server  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2"
_METRIC = re.compile(r'^arbor_(requests|errors)_total\{([^}]*)\} ([0-9.e+]+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_STATUS = re.compile(r"'(\d{3}) ")


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    return start_arbor_server(["--model", model, "--served-model-name", MODEL, "--log-level", "warning", *extra])


def statuses(url: str) -> Counter[str]:
    """The server's answers so far: successes by HTTP status (``arbor_requests_total``),
    failures by kind (``arbor_errors_total``: rate_limit_error, timeout, ...)."""
    out: Counter[str] = Counter()
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if (m := _METRIC.match(line)) is not None:
            labels = dict(_LABEL.findall(m.group(2)))
            key = labels.get("status", "?") if m.group(1) == "requests" else labels.get("kind", "?")
            out[key] += int(float(m.group(3)))
    return out


def error_statuses(bench: dict[str, Any]) -> dict[str, int]:
    """guidellm's errored requests of one run, by the HTTP status in their error."""
    out: Counter[str] = Counter()
    for req in bench.get("requests", {}).get("errored", []):
        m = _STATUS.search(str(req.get("error") or (req.get("info") or {}).get("error") or ""))
        out[m.group(1) if m else "no status"] += 1
    return dict(out)


class Probe:
    """One chat request every ``every`` s on a thread: (status, Retry-After or None)."""

    def __init__(self, url: str, every: float = 2.0) -> None:
        self.url, self.every = url, every
        self.answers: list[tuple[int, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=self.url, timeout=300) as http:
            while not self._stop.wait(self.every):
                try:
                    r = http.post("/v1/chat/completions", json=body)
                    self.answers.append((r.status_code, r.headers.get("retry-after")))
                except httpx.HTTPError as exc:
                    self.answers.append((0, type(exc).__name__))


def guidellm(url: str, tokenizer: str, profile: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run guidellm once; its JSON report."""
    exe = shutil.which("guidellm") or str(Path(sys.executable).with_name("guidellm"))
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={url},model={MODEL}",
           "--profile", profile,
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--constraint", f"kind=max_duration,seconds={args.seconds}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=args.seconds * 40 + 600)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def pct(dist: dict[str, Any], p: str) -> float | None:
    value = (dist.get("successful") or {}).get("percentiles", {}).get(p)
    return None if value is None else float(value)


def rows_of(report: dict[str, Any], phase: str) -> list[dict[str, Any]]:
    """One row per guidellm benchmark (strategy) of a report."""
    rows = []
    for bench in report["benchmarks"]:
        m, strategy = bench["metrics"], bench["config"]["strategy"]
        totals = m["request_totals"]
        rows.append({
            "phase": phase, "strategy": strategy.get("type_", strategy.get("kind")),
            "rate_asked": strategy.get("rate"),
            "requests_per_s": (m["requests_per_second"]["successful"] or {}).get("mean"),
            "output_tok_per_s": (m["output_tokens_per_second"]["successful"] or {}).get("mean"),
            "ttft_p50_ms": pct(m["time_to_first_token_ms"], "p50"),
            "ttft_p99_ms": pct(m["time_to_first_token_ms"], "p99"),
            "itl_p50_ms": pct(m["inter_token_latency_ms"], "p50"),
            "itl_p99_ms": pct(m["inter_token_latency_ms"], "p99"),
            "completed": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
            "errored_by_status": error_statuses(bench),
        })
    return rows


def save_report(report: dict[str, Any], path: Path) -> None:
    """guidellm's report without its per-request records (megabytes): the metrics stay."""
    path.parent.mkdir(parents=True, exist_ok=True)
    slim = {**report, "benchmarks": [{k: v for k, v in b.items() if k != "requests"} for b in report["benchmarks"]]}
    path.write_text(json.dumps(slim, separators=(",", ":")))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from runtime.model.default_model import default_model_dir

    tokenizer = args.tokenizer or str(default_model_dir())
    proc, url = (None, args.target) if args.target else start_server(args.model, args.server_args)
    work = Path(tempfile.mkdtemp(prefix="bench_overload_"))
    try:
        before = statuses(url)
        sweep = guidellm(url, tokenizer, f"kind=sweep,sweep_size={args.sweep_size},max_concurrency={args.max_concurrency}",
                         args, work / "sweep.json")
        after_sweep = statuses(url)
        rows = rows_of(sweep, "sweep")
        saturation = max(r["requests_per_s"] or 0.0 for r in rows)
        past_rate = round(args.past * saturation, 3)
        with Probe(url) as probe:
            past = guidellm(url, tokenizer, f"kind=constant,rate={past_rate}", args, work / "past.json")
        after_past = statuses(url)
        rows += rows_of(past, f"past saturation ({args.past:g}x)")
        save_report(sweep, RESULTS / "guidellm" / f"{args.name}_sweep.json")
        save_report(past, RESULTS / "guidellm" / f"{args.name}_past.json")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    return {"rows": rows, "saturation_requests_per_s": saturation, "past_rate": past_rate,
            "server_statuses_sweep": dict(after_sweep - before), "server_statuses_past": dict(after_past - after_sweep),
            "probe": probe.answers}


def probe_counts(answers: list[tuple[int, str | None]]) -> dict[str, int]:
    return {f"({status}, {retry})": n for (status, retry), n in Counter(map(tuple, answers)).items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--target", default=None, help="an arbor server already running (default: start one)")
    p.add_argument("--tokenizer", default=None, help="a local tokenizer directory (default: the default model's)")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds per guidellm run (each rate)")
    p.add_argument("--sweep-size", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--past", type=float, default=3.0, help="the last rate, as a multiple of saturation")
    p.add_argument("--max-concurrency", type=int, default=64, help="guidellm's cap on requests in flight")
    p.add_argument("--name", default="bench_overload")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="passed to arbor serve, e.g. --num-threads 1 --max-queue-wait 10")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    print(reproduce_line(), f"load average {load_average()}", flush=True)
    result = run(args)
    summary = [f"saturation (guidellm's throughput run): {result['saturation_requests_per_s']:.2f} requests/s; "
               f"past it: a constant {result['past_rate']} requests/s",
               f"server answers during the sweep, by status: {result['server_statuses_sweep']}",
               f"server answers past saturation, by status: {result['server_statuses_past']}",
               f"probe past saturation, (status, Retry-After): count: {probe_counts(result['probe'])}"]
    for line in summary:
        print(line)
    for row in result["rows"]:
        print(row)
    path = save_result(args.name, {"title": "Overload from outside: guidellm against arbor serve",
                                   "summary": summary, **result, "args": vars(args)})
    print(f"saved {path}  load average {load_average()}")
    return result


if __name__ == "__main__":
    main()
