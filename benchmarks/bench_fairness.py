"""Fair sharing under a flood: does one tenant's batch flood hurt another's interactive TTFT?

Both tenants in one run, on one engine, once with fair scheduling on and once off
(``EngineConfig.fair_scheduling``; off = the base policy alone, the baseline):

  alone  tenant B sends ``--interactive`` interactive requests (``--prompt-tokens`` each,
         ``--interactive-tokens`` out), one every ``--interval`` s, on an idle engine;
  flood  tenant A first submits ``--flood`` long batch jobs at once (``--batch-prompt-tokens``
         in, ``--batch-tokens`` out, EOS ignored: more than the running batch holds, so
         A saturates the engine), then B sends the same interactive requests as alone.

B's TTFT (submission to its first token) at p50/p99, flood vs alone, per mode. Target:
with fair scheduling, the flood raises B's TTFT p99 by at most 2x. Prompts are distinct
random words (no prefix-cache hits between requests).

    .venv/bin/python benchmarks/bench_fairness.py [--quick] [--model default]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, reproduce_line, save_result  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402

WORDS = ["river", "stone", "cloud", "paper", "garden", "silver", "window", "orange", "music", "forest", "engine", "letter", "market", "bridge", "winter", "candle", "planet", "doctor", "summer", "island", "yellow", "animal"]


def prompt_ids(engine: Engine, num_tokens: int, rng: random.Random) -> list[int]:
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += engine.tokenizer.encode(" ".join(rng.choices(WORDS, k=32)), add_special_tokens=False)
    return ids[:num_tokens]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


async def ttft(engine: Engine, ids: list[int], params: SamplingParams, tenant: str, priority: str,
               drains: list[asyncio.Task[None]]) -> float:
    """Submit; return at the first token (the rest of the request runs on in a task added
    to ``drains``)."""
    start = time.perf_counter()
    stream = engine.generate_stream(input_ids=ids, sampling_params=params, tenant=tenant,
                                    priority=priority)  # type: ignore[arg-type]
    async for out in stream:
        if out.delta_token_ids:
            first = time.perf_counter() - start
            drains.append(asyncio.ensure_future(drain(stream)))
            return first
    raise AssertionError("finished without a token")


async def drain(stream: Any) -> None:
    async for _ in stream:
        pass


async def interactive_series(engine: Engine, args: argparse.Namespace, rng: random.Random) -> list[float]:
    params = SamplingParams(max_new_tokens=args.interactive_tokens, temperature=0.0, ignore_eos=True)
    tasks, drains = [], []
    for _ in range(args.interactive):  # NOTE: each runs to its end (drains) after its first token
        tasks.append(asyncio.ensure_future(ttft(engine, prompt_ids(engine, args.prompt_tokens, rng),
                                                params, "B", "interactive", drains)))
        await asyncio.sleep(args.interval)
    ttfts = list(await asyncio.gather(*tasks))
    await asyncio.gather(*drains)
    return ttfts


async def flood_then_interactive(engine: Engine, args: argparse.Namespace, rng: random.Random) -> list[float]:
    params = SamplingParams(max_new_tokens=args.batch_tokens, temperature=0.0, ignore_eos=True)
    drains: list[asyncio.Task[None]] = []
    flood = [asyncio.ensure_future(ttft(engine, prompt_ids(engine, args.batch_prompt_tokens, rng),
                                        params, "A", "batch", drains)) for _ in range(args.flood)]
    # NOTE: B arrives once A holds every running slot and decodes (steady state), not
    # during the one-time prefill of A's first jobs on an idle engine.
    while sum(t.done() for t in flood) < min(args.flood, args.max_running):
        await asyncio.sleep(0.05)
    await asyncio.sleep(args.interval)
    ttfts = await interactive_series(engine, args, rng)
    for task in [*flood, *drains]:
        task.cancel()  # aborts A's remaining jobs
    await asyncio.gather(*flood, *drains, return_exceptions=True)
    return ttfts


def run_mode(args: argparse.Namespace, fair: bool) -> dict[str, Any]:
    engine = Engine(model=args.model, fair_scheduling=fair, max_running_requests=args.max_running,
                    num_threads=args.threads, speculation=False)
    try:
        rng = random.Random(args.seed)
        asyncio.run(interactive_series(engine, argparse.Namespace(**{**vars(args), "interactive": 2}), rng))  # warm-up
        alone = asyncio.run(interactive_series(engine, args, rng))
        assert engine.wait_idle(60)
        flooded = asyncio.run(flood_then_interactive(engine, args, rng))
        assert engine.wait_idle(120)
        engine.check_integrity()
    finally:
        engine.close()
    row = {"fair": fair, "alone_p50": statistics.median(alone), "alone_p99": percentile(alone, 99),
           "flood_p50": statistics.median(flooded), "flood_p99": percentile(flooded, 99),
           "alone": alone, "flood": flooded}
    row["p99_ratio"] = row["flood_p99"] / row["alone_p99"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    p.add_argument("--interactive", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--prompt-tokens", type=int, default=160)
    p.add_argument("--interactive-tokens", type=int, default=4)
    p.add_argument("--flood", type=int, default=24)
    p.add_argument("--batch-prompt-tokens", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=256)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.interactive, args.flood, args.batch_tokens = 8, 12, 96
    print(reproduce_line(), flush=True)
    rows = []
    for fair in (True, False):
        load_before = load_average()
        row = run_mode(args, fair)
        row["loadavg"] = f"{load_before} -> {load_average()}"
        rows.append(row)
        print(f"fair={'on ' if fair else 'off'}  B interactive TTFT  alone p50 {row['alone_p50'] * 1e3:7.0f} ms "
              f"p99 {row['alone_p99'] * 1e3:7.0f} ms | under A's flood p50 {row['flood_p50'] * 1e3:7.0f} ms "
              f"p99 {row['flood_p99'] * 1e3:7.0f} ms | p99 ratio {row['p99_ratio']:5.2f}x  "
              f"(load {row['loadavg']})", flush=True)
    on = rows[0]
    print(f"target: fair on keeps B's TTFT p99 within 2x of alone: {on['p99_ratio']:.2f}x "
          f"({'met' if on['p99_ratio'] <= 2 else 'NOT met'})")
    path = save_result("bench_fairness", {"command": reproduce_line(), "args": vars(args), "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
