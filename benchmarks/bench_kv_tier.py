"""Reload vs recompute: a long prefix found in the KV tier (docs/kv-tier.md) against a cold
miss and a pool hit.

One engine with a disk tier (``--kv-tier-dir``), one P-token prompt of random token ids,
one output token (so the wall time of a request is its time to first token). Each round
runs three cases, interleaved:

- cold miss: the pool and the tier emptied (``flush_cache()``), the whole prompt prefilled;
- pool hit: the same prompt again, its prefix still in the pool;
- tier hit: the pool evicted to the tier (``flush_cache(to_tier=True)``, writes waited for,
  outside the timing), so the prefix is reloaded from the tier's file.

The tier's file is written through the OS page cache; on a machine with free memory its
pages are still there when reloaded (the case measured), so a reload costs a memory copy
and a checksum, not a disk read. Medians over the rounds; the first round is a warm-up.

    .venv/bin/python benchmarks/bench_kv_tier.py [--model default|1b] [--prompt 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, reproduce_line, save_result  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402

CASES = ("cold_miss", "pool_hit", "tier_hit")


def one_request(engine: Engine, ids: list[int]) -> tuple[float, int, int]:
    """(seconds, pool-cached tokens, tier-cached tokens) of a one-token request."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params=params)[0]
    seconds = time.perf_counter() - start
    return seconds, out.num_cached_tokens - out.num_tier_cached_tokens, out.num_tier_cached_tokens


def run_case(engine: Engine, ids: list[int], case: str) -> tuple[float, int, int]:
    if case == "cold_miss":
        engine.flush_cache()
    elif case == "tier_hit":
        engine.flush_cache(to_tier=True)
        engine.wait_tier_writes()
    return one_request(engine, ids)


def model_path(name: str, work: Path) -> str:
    if name == "default":
        return "default"
    from bench_scale import write_model

    path = work / f"{name}-q4_0.gguf"
    if not path.exists():
        write_model(path, name, "Q4_0")
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", choices=("default", "1b"))
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tier-dir", default=None, help="the tier's directory (default: a temporary one)")
    ap.add_argument("--int8", action="store_true", help="store the tier's pages as int8 (kv_tier_int8)")
    ap.add_argument("--work", default="/tmp/arbor-bench-kv-tier", help="where a generated model goes")
    ap.add_argument("--name", default=None, help="result name (default: bench_kv_tier[_<model>])")
    args = ap.parse_args()
    print(reproduce_line(), flush=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tier_dir = args.tier_dir or tempfile.mkdtemp(prefix="arbor-kv-tier-", dir=work)
    page = 16
    pages = args.prompt // page + 8
    engine = Engine(model=model_path(args.model, work), page_size=page, num_pages=pages + 1,
                    max_model_len=args.prompt + 16, num_threads=args.threads, kv_tier_dir=tier_dir,
                    kv_tier_max_bytes=2**31, kv_tier_int8=args.int8, prefix_cache_max_pages=pages)
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(args.prompt)]
    times: dict[str, list[float]] = {c: [] for c in CASES}
    cached: dict[str, tuple[int, int]] = {}
    for r in range(args.rounds + 1):
        order = CASES if r % 2 == 0 else (CASES[0], CASES[2], CASES[1])  # NOTE: pool/tier alternate second
        for case in order:
            seconds, pool, tier = run_case(engine, ids, case)
            print(f"round {r} {case}: {seconds:.3f} s (pool {pool}, tier {tier})", flush=True)
            cached[case] = (pool, tier)
            if r:
                times[case].append(seconds)
    engine.check_integrity()
    slot_bytes = getattr(engine.tier, "slot_bytes", 0)
    engine.close()
    med = {c: statistics.median(v) for c, v in times.items()}
    rows: list[dict[str, Any]] = [
        {"case": c, "ttft_median_s": round(med[c], 4), "ttft_min_s": round(min(times[c]), 4),
         "pool_cached_tokens": cached[c][0], "tier_cached_tokens": cached[c][1],
         "vs_cold_miss": round(med["cold_miss"] / med[c], 2)}
        for c in CASES]
    summary = [f"{args.prompt}-token prefix, {args.model} model, {args.threads} threads, page {page}"
               f"{', int8 tier' if args.int8 else ''}: TTFT median cold miss {med['cold_miss']:.3f} s, "
               f"tier hit {med['tier_hit']:.3f} s ({med['cold_miss'] / med['tier_hit']:.1f}x faster), "
               f"pool hit {med['pool_hit']:.3f} s; tier page {slot_bytes} bytes",
               f"load average at the end: {load_average()}"]
    for line in summary:
        print(line)
    name = args.name or ("bench_kv_tier" if args.model == "default" else f"bench_kv_tier_{args.model}")
    print(save_result(name, {"title": f"KV tier: reload vs recompute ({args.model} model)", "summary": summary,
                             "rows": rows, "times_s": times, "prompt_tokens": args.prompt}))


if __name__ == "__main__":
    main()
