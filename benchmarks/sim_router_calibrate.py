"""Measure the service-time model of ``sim_router.py`` on this engine: prefill seconds per
uncached prompt token and decode seconds per generated token at a batch, on the default
model (SmolLM2-135M), the prefix cache off so every prompt token is computed.

    prefill_s_per_token  = (t(1 prompt of 1024) - t(1 prompt of 256)) / 768, 1 new token each
    decode_s_per_token   = (t(B prompts, 65 new) - t(B prompts, 1 new)) / (B * 64), B = --batch
    request_overhead_s   = t(1 prompt of 256) - 256 * prefill_s_per_token

Each time is the median of ``--repeats`` runs after a warm-up. Writes
``benchmarks/results/sim_router_calibration.json`` (read by ``sim_router.py``).

    .venv/bin/python benchmarks/sim_router_calibrate.py [--model default] [--batch 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, load_average, median, reproduce_line, timed  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402


def run(engine: Engine, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, speculation=False)
    engine.generate(input_ids=prompts, sampling_params=params)
    return median([timed(engine.generate, input_ids=prompts, sampling_params=params)[0] for _ in range(repeats)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = Engine(model=args.model, disable_prefix_cache=True, num_threads=args.threads,
                    max_model_len=2048, num_pages=8192)
    base = [1 + (i * 7919) % 40000 for i in range(1024)]
    short, long = run(engine, [base[:256]], 1, args.repeats), run(engine, [base], 1, args.repeats)
    batch = [[1 + (i * 31 + b * 977) % 40000 for i in range(32)] for b in range(args.batch)]
    one, many = run(engine, batch, 1, args.repeats), run(engine, batch, 65, args.repeats)
    engine.close()
    prefill = (long - short) / 768
    result = {"model": args.model, "threads": args.threads, "batch": args.batch, "loadavg": load_average(),
              "prefill_s_per_token": prefill, "decode_s_per_token": (many - one) / (args.batch * 64),
              "request_overhead_s": max(0.0, short - 256 * prefill),
              "raw_s": {"prefill_256": short, "prefill_1024": long, "batch_1_new": one, "batch_65_new": many},
              "command": reproduce_line()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sim_router_calibration.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
