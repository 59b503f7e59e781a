"""TP=2 vs TP=1: greedy agreement on 8 prompts and decode throughput. On CUDA (the
default) the ranks talk over NCCL and need 2 devices (NCCL refuses two ranks on one
device; on fewer it says so and exits); ``--device cpu`` runs them over gloo, each rank
with ``--threads`` torch threads (TP=1 gets the same total). Both sides run in this one
invocation on the same model and prompts:

- greedy: 32 new tokens per prompt; reports how many prompts agree token for token, and
  for the others the first differing position (bf16 all-reduces sum in another order, so
  near-ties may flip; in fp32, ``--dtype float32``, they should all agree);
- decode: ``--batch`` prompts x ``--new-tokens`` tokens (ignore_eos), median of
  ``--repeats`` runs after a warm-up; tokens/s and the TP=2 / TP=1 ratio.

    python benchmarks/bench_tp.py [--device cuda|cpu] [--model default] [--dtype auto] [--batch 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "The quick brown fox", "Q: What is the boiling point of water?\nA:", "import numpy as np\n",
           "Roses are red, violets are"]


def measure(args: argparse.Namespace, tp: int) -> tuple[list[list[int]], float]:
    threads = {"num_threads": args.threads * (2 // tp)} if args.device == "cpu" else {}
    with Engine(model=args.model, device=args.device, dtype=args.dtype, tensor_parallel_size=tp, **threads) as engine:
        greedy = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
        tokens = [o.token_ids for o in engine.generate(PROMPTS, greedy)]
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, speculation=False)
        prompts = [PROMPTS[i % len(PROMPTS)] + f" (variant {i})" for i in range(args.batch)]
        engine.generate(prompts, params)  # warm-up
        times = []
        for _ in range(args.repeats):
            _sync(args.device)
            start = time.perf_counter()
            engine.generate(prompts, params)
            _sync(args.device)
            times.append(time.perf_counter() - start)
    return tokens, args.batch * args.new_tokens / median(times)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads per TP=2 rank")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(reproduce_line())
    if args.device.startswith("cuda") and torch.cuda.device_count() < 2:
        raise SystemExit(f"TP=2 over NCCL needs 2 CUDA devices; this machine has {torch.cuda.device_count()}")
    one, one_tps = measure(args, 1)
    two, two_tps = measure(args, 2)
    agree = sum(a == b for a, b in zip(one, two, strict=True))
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
        if a != b:
            first = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            print(f"prompt {i}: first difference at token {first}")
    print(f"greedy agreement: {agree}/{len(PROMPTS)} prompts; decode TP=1 {one_tps:.0f} tok/s, "
          f"TP=2 {two_tps:.0f} tok/s ({two_tps / one_tps:.2f}x)")
    print(f"load average: {load_average()}")
    save_result(f"bench_tp_{args.device.split(':')[0]}", {"args": vars(args), "agree": agree, "tp1_tok_s": one_tps,
                                  "tp2_tok_s": two_tps, "command": reproduce_line()})


if __name__ == "__main__":
    main()
