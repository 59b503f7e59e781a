"""Online serving benchmark: Poisson arrivals against any OpenAI-compatible server
(``--base-url``), streaming every request.

The default workload (``natural``) is what a llama.cpp or vLLM maintainer would accept:
distinct natural text (windows of the Python documentation's topic pages, ``pydoc_data``,
which ships with CPython), prompt lengths log-uniform in ``--prompt-tokens`` (64-1,024)
and output lengths log-uniform in ``--output-tokens`` (64-256), cut with the model's
tokenizer, ``ignore_eos`` so every output runs to its length. Other buckets: short/long
input × short/long output (``/completions``, words of the same text), and ``multi_turn``:
conversations over ``/chat/completions`` that share one long system prompt and grow turn
by turn (prefix-cache reuse). Requests arrive as a Poisson process at ``--rate`` per
second (a conversation arrives once and then runs its turns back to back). Per bucket:
TTFT, ITL, TPOT and end-to-end p50/p95/p99 and output tokens/s; overall throughput. A
second table groups the same requests by prompt length in the server's own buckets
(``runtime.server.metrics.prompt_bucket``, the ``prompt_bucket`` label of ``/metrics``).

Tokens, not SSE chunks: a chunk may carry several tokens (speculation accepts a few at a
time; a token with no text of its own rides with the next). Output token counts come from
``usage`` (``stream_options.include_usage``) on every server. By default no logprobs are
asked for (a server that computes them does more work than one that ignores them), so
ITL is per chunk, as vLLM's ``benchmark_serving`` reports it: the gaps a reader sees; TPOT
= (end-to-end - TTFT) / (output tokens - 1) from ``usage`` is per token on every server.
``--token-logprobs`` asks for each chosen token's logprob, so every chunk says how many
tokens it carries and ITL is per token (a gap that ends in a chunk of k tokens counts as k
gaps of gap/k) — only fair between servers that both compute them.

Baseline, measured in the same run: the same requests (other words, so no prefix-cache
hits from the online run) sent one at a time (``--no-baseline`` skips it). Saves
``benchmarks/results/<name>.json`` and latency CDF plots (matplotlib, in the ``dev``
extra): ``<name>_cdf.png`` (one curve per workload bucket) and ``<name>_cdf_prompt.png``
(one per prompt-length bucket), each with TTFT, ITL and end-to-end panels.

Canary vs baseline: ``--compare-url`` runs the same workload against a second server
after the first and prints both side by side, each labelled with the model and config
version its answers carry (``X-Arbor-Model``, ``X-Arbor-Config-Version``).

    arbor serve --model default --port 30000 &
    .venv/bin/python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000/v1 \
        --rate 0.5 --num-requests 20

Engine against engine (servers launched one at a time, a rate sweep from each side's
saturation, sides alternated, repeats, a table and a plot): ``bench_serving_peers.py``.

Peer: llama.cpp's ``llama-server`` on the same GGUF, built by
``benchmarks/peers/build_llama_cpp.sh`` (the ``bench`` extra's llama-cpp-python sdist,
its vendored llama.cpp); ``bench_serving_peers.py`` launches it with ``-np N``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, load_average, reproduce_line, save_result  # noqa: E402

from runtime.server.metrics import PROMPT_BUCKET_BOUNDS, prompt_bucket  # noqa: E402

BUCKETS = ("natural", "short_in/short_out", "short_in/long_out", "long_in/short_out",
           "long_in/long_out", "multi_turn")


@dataclass(frozen=True)
class Workload:
    prompt_tokens: tuple[int, int]  # the natural bucket's prompt lengths: log-uniform in [lo, hi]
    output_tokens: tuple[int, int]  # its output lengths, likewise
    short_input: int  # words (~1.3 tokens each)
    long_input: int
    short_output: int  # tokens
    long_output: int
    turns: int  # turns per multi-turn conversation
    system_words: int  # shared system prompt of the multi-turn bucket


@dataclass
class Sample:
    """One finished (or failed) request, timed on the client."""

    bucket: str
    tenant: str | None = None
    ttft: float | None = None  # seconds to the first chunk that carries a token
    itl: list[float] = field(default_factory=list)  # per chunk, or per token (see above)
    e2e: float | None = None
    max_tokens: int = 0  # what the request asked for (with ignore_eos, what it gets)
    prompt_tokens: int = 0
    output_tokens: int = 0  # from usage, else the streamed counts below
    streamed_tokens: int = 0  # tokens counted chunk by chunk (logprob entries, else chunks)
    counted_by: str = "usage"  # "usage", "logprobs" or "chunks": where output_tokens came from
    itl_per: str = "chunk"  # "token" (chunks carried per-token logprobs) or "chunk"
    error: str | None = None


@dataclass(frozen=True)
class Job:
    """A unit of arrival: one request, or one conversation of several turns."""

    bucket: str
    prompt: str  # the request's prompt, or the conversation's first user message
    max_tokens: int
    tenant: str | None = None  # sent as the OpenAI ``user`` field (the server's tenant label)


class TextSource:
    """Distinct natural text: the Python documentation's topic pages (``pydoc_data``, part
    of CPython), as one token stream cut into consecutive windows, so no two prompts of a
    run share text (a prefix cache or a prompt-lookup draft gains nothing from overlap).

    Args:
        tokenizer: a ``tokenizer.json`` file, or a directory holding one (the served
            model's: windows are cut to its token counts).
        seed: where in the stream the first window starts.
    """

    def __init__(self, tokenizer: Path, seed: int) -> None:
        from pydoc_data.topics import topics

        from tokenizers import Tokenizer

        path = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
        self.tokenizer = Tokenizer.from_file(str(path))
        text = "\n\n".join(topics[k].strip() for k in sorted(topics))
        self.ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        self.pos = random.Random(seed).randrange(len(self.ids))

    def prompt(self, num_tokens: int) -> str:
        """The next ``num_tokens`` tokens of the stream as text (wrapping at its end)."""
        if num_tokens > len(self.ids):
            raise ValueError(f"{num_tokens} tokens asked, the text has {len(self.ids)}")
        window = (self.ids + self.ids)[self.pos:self.pos + num_tokens]
        self.pos = (self.pos + num_tokens) % len(self.ids)
        return str(self.tokenizer.decode(window))

    def words(self, n: int) -> str:
        """About ``n`` words: ``n`` * 4 / 3 tokens (English text is ~1.3 tokens a word)."""
        return self.prompt(max(1, n * 4 // 3))


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi] whose logarithm is uniform: as many prompts of 64-128 tokens
    as of 512-1,024, the spread of chat and agent traces rather than one typical size."""
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def make_jobs(num: int, load: Workload, seed: int, buckets: list[str], tenants: int = 0,
              text: TextSource | None = None) -> list[Job]:
    """``num`` jobs cycling over ``buckets`` (and over ``tenants`` tenants, if any), shuffled.
    ``text``: where prompts come from (default: the default model's tokenizer)."""
    rng = random.Random(seed)
    text = text or TextSource(default_tokenizer(), seed)
    sizes = {"short_in": load.short_input, "long_in": load.long_input,
             "short_out": load.short_output, "long_out": load.long_output}
    jobs = []
    for i in range(num):
        bucket = buckets[i % len(buckets)]
        if bucket == "natural":
            prompt_len, output_len = log_uniform(rng, *load.prompt_tokens), log_uniform(rng, *load.output_tokens)
            jobs.append(Job(bucket, text.prompt(prompt_len), output_len))
        elif bucket == "multi_turn":
            jobs.append(Job(bucket, text.words(load.short_input), load.short_output))
        else:
            inp, out = bucket.split("/")
            jobs.append(Job(bucket, text.words(sizes[inp]), sizes[out]))
    if tenants:
        jobs = [dataclasses.replace(j, tenant=f"tenant-{i % tenants}") for i, j in enumerate(jobs)]
    rng.shuffle(jobs)
    return jobs


def default_tokenizer() -> Path:
    """The default model's tokenizer (the converted directory; made on first use)."""
    from runtime.model.default_model import default_model_dir

    return default_model_dir()


class Client:
    """Streams one request and times its chunks."""

    def __init__(self, http: httpx.AsyncClient, model: str, ignore_eos: bool, system: str,
                 token_logprobs: bool = False, extra: dict[str, Any] | None = None) -> None:
        self.http = http
        self.model = model
        self.ignore_eos = ignore_eos
        self.system = system
        self.token_logprobs = token_logprobs
        self.extra = extra or {}  # more body fields on every request (e.g. a server's own)

    async def completion(self, job: Job) -> Sample:
        body: dict[str, Any] = {"prompt": job.prompt, "max_tokens": job.max_tokens}
        if self.token_logprobs:
            body["logprobs"] = 0  # the chosen token's logprob: one entry per token
        return await self._stream("/completions", body, job, lambda c: c.get("text"))

    async def conversation(self, job: Job, turns: int) -> list[Sample]:
        messages: list[dict[str, str]] = [{"role": "system", "content": self.system}]
        samples = []
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Turn {turn}: {job.prompt}"})
            pieces: list[str] = []
            body: dict[str, Any] = {"messages": messages, "max_tokens": job.max_tokens}
            if self.token_logprobs:
                body["logprobs"] = True
            sample = await self._stream("/chat/completions", body, job,
                                        lambda c: (c.get("delta") or {}).get("content"), pieces)
            samples.append(sample)
            if sample.error is not None:
                break
            messages.append({"role": "assistant", "content": "".join(pieces)})
        return samples

    async def _stream(self, path: str, body: dict[str, Any], job: Job, text_of: Any,
                      pieces: list[str] | None = None) -> Sample:
        body = {**body, "model": self.model, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **self.extra}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if job.tenant is not None:
            body["user"] = job.tenant
        sample = Sample(job.bucket, job.tenant, max_tokens=job.max_tokens,
                        itl_per="token" if self.token_logprobs else "chunk")
        usage: dict[str, int] | None = None
        start = last = time.perf_counter()
        try:
            async with self.http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    sample.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return sample
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        sample.error = str(chunk["error"])
                        return sample
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    choices = chunk.get("choices", [])
                    text = "".join(text_of(c) or "" for c in choices)
                    if pieces is not None:
                        pieces.append(text)
                    num_tokens = tokens_in(choices, text) if self.token_logprobs else (1 if text else 0)
                    if num_tokens is None:  # text but no logprob entries: count the chunk
                        sample.itl_per, num_tokens = "chunk", 1
                    if not num_tokens:
                        continue
                    now = time.perf_counter()
                    if sample.ttft is None:
                        sample.ttft = now - start
                    else:  # NOTE: k tokens in this chunk: k inter-token gaps of gap/k
                        sample.itl.extend([(now - last) / num_tokens] * num_tokens)
                    last = now
                    sample.streamed_tokens += num_tokens
        except httpx.HTTPError as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
            return sample
        sample.e2e = time.perf_counter() - start
        if usage is not None:
            sample.prompt_tokens, sample.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        else:
            sample.counted_by = "logprobs" if sample.itl_per == "token" else "chunks"
            sample.output_tokens = sample.streamed_tokens
        return sample


def tokens_in(choices: list[dict[str, Any]], text: str) -> int | None:
    """Tokens a chunk carries, from its per-token logprob entries (``logprobs.tokens`` of
    completions, ``logprobs.content`` of chat); None when the chunk has text but no entries."""
    entries = [c["logprobs"] for c in choices if c.get("logprobs")]
    if not entries:
        return None if text else 0
    return sum(len(e.get("tokens") or e.get("content") or []) for e in entries)


def workload(http: httpx.AsyncClient, model: str, args: argparse.Namespace, load: Workload,
             buckets: list[str], seed: int) -> tuple[Client, list[Job], int, int]:
    """A client (with its conversations' shared system prompt) and the jobs for ``seed``."""
    text = TextSource(Path(args.tokenizer) if args.tokenizer else default_tokenizer(), seed)
    system = "You are a careful assistant. Background: " + text.words(load.system_words)
    client = Client(http, model, args.ignore_eos, system, args.token_logprobs)
    return client, make_jobs(args.num_requests, load, seed, buckets, args.tenants, text), load.turns, seed


async def run_jobs(client: Client, jobs: list[Job], turns: int, seed: int,
                   rate: float | None) -> tuple[list[Sample], float]:
    """Send ``jobs`` at Poisson arrivals of ``rate`` per second (None: one at a time)."""
    rng = random.Random(seed + 1)
    samples: list[Sample] = []

    async def one(job: Job, delay: float) -> None:
        await asyncio.sleep(delay)
        if job.bucket == "multi_turn":
            samples.extend(await client.conversation(job, turns))
        else:
            samples.append(await client.completion(job))

    start = time.perf_counter()
    if rate is None:
        for job in jobs:
            await one(job, 0.0)
    else:
        arrivals, t = [], 0.0
        for _ in jobs:
            t += rng.expovariate(rate)
            arrivals.append(t)
        await asyncio.gather(*(one(j, a) for j, a in zip(jobs, arrivals, strict=True)))
    return samples, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    p = np.percentile(np.array(values) * 1000.0, [50, 95, 99])
    return {"p50": round(float(p[0]), 2), "p95": round(float(p[1]), 2), "p99": round(float(p[2]), 2)}


def prompt_groups(samples: list[Sample]) -> dict[str, list[Sample]]:
    """Samples by the server's prompt-length bucket, in bucket order (needs usage counts)."""
    order = [prompt_bucket(b) for b in PROMPT_BUCKET_BOUNDS] + [prompt_bucket(PROMPT_BUCKET_BOUNDS[-1] + 1)]
    groups: dict[str, list[Sample]] = {b: [] for b in order}
    for s in samples:
        if s.prompt_tokens:
            groups[prompt_bucket(s.prompt_tokens)].append(s)
    return {b: g for b, g in groups.items() if g}


def bucket_stats(group: list[Sample]) -> dict[str, Any]:
    decode_time = sum(sum(s.itl) for s in group)
    return {
        "count": len(group),
        "mean_prompt_tokens": round(sum(s.prompt_tokens for s in group) / len(group), 1),
        "mean_output_tokens": round(sum(s.output_tokens for s in group) / len(group), 1),
        "ttft_ms": percentiles([s.ttft for s in group if s.ttft is not None]),
        "itl_ms": percentiles([x for s in group for x in s.itl]),
        "e2e_ms": percentiles([s.e2e for s in group if s.e2e is not None]),
        "tpot_ms": percentiles([t for s in group if (t := tpot(s)) is not None]),
        "decode_tokens_per_s": round(sum(len(s.itl) for s in group) / decode_time, 2) if decode_time else None,
    }


def tpot(s: Sample) -> float | None:
    """Seconds per output token after the first: (end-to-end - TTFT) / (tokens - 1)."""
    if s.e2e is None or s.ttft is None or s.output_tokens < 2:
        return None
    return (s.e2e - s.ttft) / (s.output_tokens - 1)


def summarize(samples: list[Sample], duration: float) -> dict[str, Any]:
    """Throughput over the run and latencies (ms) per bucket (workload and prompt length)
    and overall."""
    ok = [s for s in samples if s.error is None]
    out_tokens = sum(s.output_tokens for s in ok)
    summary: dict[str, Any] = {
        "duration_s": round(duration, 2), "num_requests": len(samples), "num_ok": len(ok),
        "errors": [s.error for s in samples if s.error is not None][:5],
        "output_tokens_counted_by": sorted({s.counted_by for s in ok}),
        "itl_per": sorted({s.itl_per for s in ok}),
        "request_throughput": round(len(ok) / duration, 3),
        "output_token_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((out_tokens + sum(s.prompt_tokens for s in ok)) / duration, 2),
        "buckets": {},
        "prompt_buckets": {b: bucket_stats(g) for b, g in prompt_groups(ok).items()},
        "tenants": {t: bucket_stats([s for s in ok if s.tenant == t])
                    for t in sorted({s.tenant for s in ok if s.tenant is not None})},
    }
    groups = {b: [s for s in ok if s.bucket == b] for b in BUCKETS}
    groups["all"] = ok
    summary["buckets"] = {b: bucket_stats(g) for b, g in groups.items() if g}
    return summary


def print_summary(title: str, summary: dict[str, Any]) -> None:
    print(f"\n== {title}: {summary['num_ok']}/{summary['num_requests']} ok in {summary['duration_s']} s; "
          f"{summary['request_throughput']} req/s, {summary['output_token_throughput']} output tok/s, "
          f"{summary['total_token_throughput']} total tok/s")
    header = f"{'bucket':<20}{'n':>4}{'in':>7}{'out':>6}" + "".join(
        f"{m + ' ' + p:>13}" for m in ("TTFT", "ITL", "E2E") for p in ("p50", "p95", "p99"))
    print(header + "   (ms)")
    print_rows(summary["buckets"])
    if summary.get("prompt_buckets"):
        print("by prompt length, tokens (the prompt_bucket label of the server's /metrics):")
        print_rows({f"prompt {b}": stats for b, stats in summary["prompt_buckets"].items()})
    if summary.get("tenants"):
        print("by tenant (the OpenAI user field: the tenant label of the server's /metrics):")
        print_rows(summary["tenants"])
    print(f"output tokens counted by: {', '.join(summary['output_tokens_counted_by']) or '-'}; "
          f"ITL per {', '.join(summary['itl_per']) or '-'}")
    for error in summary["errors"]:
        print("  error:", error)


def print_rows(buckets: dict[str, dict[str, Any]]) -> None:
    for bucket, b in buckets.items():
        cells = [b[k][p] for k in ("ttft_ms", "itl_ms", "e2e_ms") for p in ("p50", "p95", "p99")]
        print(f"{bucket:<20}{b['count']:>4}{b['mean_prompt_tokens']:>7.0f}{b['mean_output_tokens']:>6.0f}"
              + "".join(f"{c if c is not None else '-':>13}" for c in cells))


def plot_cdf(groups: dict[str, list[Sample]], path: Path, title: str) -> Path:
    """TTFT, ITL and E2E latency CDFs, one curve per group (bucket), as a PNG.

    matplotlib is in the ``dev`` extra (``make setup`` installs it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    metrics = {"TTFT": lambda s: [s.ttft] if s.ttft is not None else [], "ITL": lambda s: s.itl,
               "E2E": lambda s: [s.e2e] if s.e2e is not None else []}
    for ax, (name, pick) in zip(axes, metrics.items(), strict=True):
        for bucket, group in groups.items():
            values = sorted(v * 1000 for s in group if s.error is None for v in pick(s))
            if values:
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=bucket)
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of samples")
        ax.set_xscale("log")
        ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))  # 1-2-5 labels, plain numbers
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000/v1", help="OpenAI-compatible base URL")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model id (default: the first of /models)")
    p.add_argument("--rate", type=float, default=1.0, help="arrivals per second (Poisson)")
    p.add_argument("--num-requests", type=int, default=40, help="arrivals (a conversation counts once)")
    p.add_argument("--buckets", default="natural", help=f"comma-separated, of {', '.join(BUCKETS)}")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=(64, 1024), metavar=("LO", "HI"),
                   help="the natural bucket's prompt lengths: log-uniform in [LO, HI] tokens")
    p.add_argument("--output-tokens", type=int, nargs=2, default=(64, 256), metavar=("LO", "HI"),
                   help="the natural bucket's output lengths: log-uniform in [LO, HI] tokens")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (or a directory with one) that prompts are cut with "
                        "(default: the default model's)")
    p.add_argument("--short-input", type=int, default=24, help="words")
    p.add_argument("--long-input", type=int, default=400, help="words")
    p.add_argument("--short-output", type=int, default=16, help="tokens")
    p.add_argument("--long-output", type=int, default=96, help="tokens")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so output lengths are exact (an Arbor/vLLM/SGLang extension)")
    p.add_argument("--token-logprobs", action=argparse.BooleanOptionalAction, default=False,
                   help="ask for each chosen token's logprob, so every chunk says how many tokens "
                        "it carries and ITL is per token (default off: ITL per chunk; only fair "
                        "between servers that both compute logprobs)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also send the same requests one at a time (the baseline)")
    p.add_argument("--tenants", type=int, default=0,
                   help="spread requests over N tenants (the OpenAI user field); 0: name none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="bench_serving")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--compare-url", default=None,
                   help="a second server (e.g. the canary): the same workload runs against it after "
                        "--base-url, and both are printed side by side with their model and config "
                        "version (X-Arbor-Model / X-Arbor-Config-Version)")
    return p.parse_args(argv)


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(tuple(args.prompt_tokens), tuple(args.output_tokens), args.short_input, args.long_input,
                    args.short_output, args.long_output, args.turns, args.system_words)


async def main_async(args: argparse.Namespace, base_url: str | None = None,
                     name: str | None = None) -> dict[str, Any]:
    base_url = base_url or args.base_url
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    load = workload_of(args)
    buckets = [b for b in args.buckets.split(",") if b]
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers,
                                 timeout=args.timeout, limits=limits) as http:
        listing = await http.get("/models")
        model = args.model or listing.json()["data"][0]["id"]
        version = {"model": listing.headers.get("X-Arbor-Model"),
                   "config_version": listing.headers.get("X-Arbor-Config-Version")}
        await Client(http, model, args.ignore_eos, "", args.token_logprobs).completion(Job("warmup", "warm up", 2))
        online, online_s = await run_jobs(*workload(http, model, args, load, buckets, args.seed), args.rate)
        baseline = None
        if args.baseline:  # NOTE: other words, so it gets no prefix-cache hits from the online run
            baseline = await run_jobs(*workload(http, model, args, load, buckets, args.seed + 1000), None)
    result: dict[str, Any] = {"command": reproduce_line(), "base_url": base_url, "model": model,
                              "server_version": version, "rate": args.rate, "workload": load.__dict__,
                              "online": summarize(online, online_s)}
    print_summary(f"{base_url} (model {version['model']}, config {version['config_version']}): "
                  f"online, Poisson rate {args.rate}/s", result["online"])
    if baseline is not None:
        result["baseline_sequential"] = summarize(*baseline)
        print_summary("baseline: same requests one at a time", result["baseline_sequential"])
        ratio = result["online"]["output_token_throughput"] / max(1e-9, result["baseline_sequential"]["output_token_throughput"])
        result["throughput_vs_baseline"] = round(ratio, 2)
        print(f"\noutput token throughput, online vs sequential baseline: {ratio:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    title = f"{model} at {args.rate} req/s"
    by_workload = {b: [s for s in online if s.bucket == b] for b in BUCKETS}
    result["cdf_png"] = [str(plot_cdf(by_workload, RESULTS / f"{name or args.name}_cdf.png", title + ", by workload bucket")),
                         str(plot_cdf(prompt_groups(online), RESULTS / f"{name or args.name}_cdf_prompt.png",
                                      title + ", by prompt length (tokens)"))]
    return result


def print_comparison(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two servers side by side (canary vs baseline): the same workload's overall figures,
    and each server's model and config version (X-Arbor-* headers) so they are told apart."""
    rows: dict[str, Any] = {}
    print(f"\n== side by side: A = {a['base_url']} {a['server_version']}\n"
          f"                 B = {b['base_url']} {b['server_version']}")
    print(f"{'figure':<24}{'A':>12}{'B':>12}{'B / A':>9}")
    pairs = [("output tok/s", a["online"]["output_token_throughput"], b["online"]["output_token_throughput"])]
    for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
        for p in ("p50", "p99"):
            pairs.append((f"{metric[:-3].upper()} {p} (ms)", a["online"]["buckets"].get("all", {}).get(metric, {}).get(p),
                          b["online"]["buckets"].get("all", {}).get(metric, {}).get(p)))
    for label, x, y in pairs:
        ratio = y / x if x and y is not None else None
        rows[label] = {"A": x, "B": y, "B/A": ratio}
        print(f"{label:<24}{x if x is not None else '-':>12}{y if y is not None else '-':>12}"
              f"{f'{ratio:.2f}x' if ratio is not None else '-':>9}")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(reproduce_line(), f"(load average {load_average()})")
    result = asyncio.run(main_async(args))
    if args.compare_url:
        other = asyncio.run(main_async(args, args.compare_url, args.name + "_compare"))
        result = {"A": result, "B": other, "side_by_side": print_comparison(result, other)}
        result["cdf_png"] = result["A"]["cdf_png"]
    path = save_result(args.name, result)
    print(f"saved {path} and {', '.join(result['cdf_png'])}")


if __name__ == "__main__":
    main()
