"""Offline decode throughput: Arbor vs HF transformers `generate`, same weights, fp32.

Each batch size runs both systems on the same prompts (prompt 128 tokens, 128 new tokens,
greedy, EOS ignored, so both sides produce the same token counts) and prints tokens/s
and the ratio. HF loads the converted default-model directory in fp32 with SDPA
attention and generates one left-padded batch with ``min_new_tokens = max_new_tokens``.

Fair by construction:

- each side runs in its own worker process, as a user would run it: on this 2-core CPU,
  torch's OpenMP runtime gets ~3x slower on small ops in a thread once another live thread
  of the same process has its own OpenMP team (measured: 20,000 batch-1 1536x576
  linears, 1.4 s alone vs 4.0 s with a second thread parked after using torch; the spin
  before a worker sleeps is throttled once a process holds more OpenMP threads than
  cores), so HF in the process of Arbor's engine thread ran ~30% slower than alone;
- every prompt is BOS followed by seeded random ids from ordinary vocabulary, and no two
  prompts in the run (warm-ups, batches and repeats) share their second token, so none
  shares a prefix with another beyond BOS;
- Arbor runs with the prefix cache off and speculation off, and the benchmark asserts that
  no prompt token was served from a cache (``cached_prompt_tokens`` stays 0) and that
  every prompt token was prefilled during the timed runs;
- both sides get an untimed warm-up on a separate small batch, each repeat alternates
  which side runs first (the other waits, idle), and each repeat's ratio is printed.

    .venv/bin/python benchmarks/bench_offline.py [--batches 1 8 32 64] [--repeats 3]
        [--threads N] [--no-prepack] [--torch-kernels]

On a machine shared with other work, HF's two OpenMP threads stall at every barrier while
another process holds a core (measured at load ~4 on 2 cores: HF batch 8 at 5.7-64 tok/s
across repeats), so read ratios only at low load, or compare both sides at
``--threads 1``.

``--no-prepack`` runs Arbor with plain ``F.linear`` weights (``prepack_weights=False``),
the baseline for the oneDNN-prepacked linears; ``--torch-kernels`` runs attention, norms,
activation and rotary embedding on the torch reference instead of the native CPU kernels
(``kernels/cpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import random
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from transformers import AutoTokenizer

import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result, timed  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402
from runtime.model.default_model import default_model_dir  # noqa: E402

# NOTE: ids 0-16 are special tokens in the default model's vocabulary; 1000-40000 are
# ordinary word pieces (" properly", " Brow", " neoliberal", ...).
ORDINARY_IDS = range(1000, 40000)


class PromptMaker:
    """Prompts that share nothing but BOS: each draws its second token, without
    replacement, from one pool for the whole run, and the rest at random."""

    def __init__(self, bos_id: int, seed: int) -> None:
        self.bos_id = bos_id
        self.rng = random.Random(seed)
        self.unused_firsts = self.rng.sample(ORDINARY_IDS, len(ORDINARY_IDS))

    def make(self, batch: int, prompt_len: int) -> list[list[int]]:
        if len(self.unused_firsts) < batch:
            raise ValueError("out of distinct first tokens")
        return [[self.bos_id, self.unused_firsts.pop(),
                 *self.rng.choices(ORDINARY_IDS, k=prompt_len - 2)] for _ in range(batch)]


def run_arbor(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of one batch; asserts it was all prefilled, none served from a cache."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    before = engine.metrics()
    seconds, outs = timed(engine.generate, input_ids=prompts, sampling_params=params)
    after = engine.metrics()
    assert all(len(o.token_ids) == new_tokens for o in outs)
    assert after["cached_prompt_tokens"] == before["cached_prompt_tokens"] == 0, "a cache hit"
    assert after["num_retractions"] == before["num_retractions"], "a retraction recomputed a prefill"
    prefilled = after["prefill_tokens"] - before["prefill_tokens"]
    assert prefilled == sum(len(p) for p in prompts), f"prefilled {prefilled} prompt tokens"
    return len(prompts) * new_tokens / seconds


def run_hf(model, pad_id: int, prompts: list[list[int]], new_tokens: int) -> float:  # type: ignore[no-untyped-def]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        seconds, out = timed(model.generate, input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id)
    assert out.shape[1] == width + new_tokens
    return len(prompts) * new_tokens / seconds


# ---- worker processes: one per side, each loads its side once then times batches ----------
_side: Callable[[list[list[int]], int], float] | None = None  # this worker's run_arbor / run_hf


def _start_arbor(speculation: bool, prepack: bool, torch_kernels: bool, threads: int | None) -> None:
    global _side
    engine = Engine(model="default", page_size=16, disable_prefix_cache=True,
                    speculation=speculation, prepack_weights=prepack, num_threads=threads)
    if torch_kernels:
        kernels.set_kernel_backend("torch")
    _side = functools.partial(run_arbor, engine)


def _start_hf(model_dir: str, pad_id: int, threads: int | None) -> None:
    global _side
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    _side = functools.partial(run_hf, model, pad_id)


def _run(prompts: list[list[int]], new_tokens: int) -> float:
    assert _side is not None
    return _side(prompts, new_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--no-prepack", action="store_true", help="plain F.linear weights (the baseline)")
    ap.add_argument("--torch-kernels", action="store_true",
                    help="the torch reference ops instead of the native CPU kernels (their baseline)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of each side (default: torch's, one per core); 1 keeps a "
                         "shared machine's other load from stalling one side's OpenMP barriers")
    ap.add_argument("--speculation", action="store_true",
                    help="leave prompt-lookup speculation on (off by default: this measures plain decode)")
    args = ap.parse_args()
    print(reproduce_line())
    model_dir = str(default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id or 0
    prompts = PromptMaker(tokenizer.bos_token_id, args.seed)
    spawn = multiprocessing.get_context("spawn")
    with contextlib.ExitStack() as stack:
        workers = {"arbor": stack.enter_context(ProcessPoolExecutor(
            1, spawn, initializer=_start_arbor,
            initargs=(args.speculation, not args.no_prepack, args.torch_kernels, args.threads)))}
        if not args.skip_hf:
            workers["hf"] = stack.enter_context(ProcessPoolExecutor(
                1, spawn, initializer=_start_hf, initargs=(model_dir, pad_id, args.threads)))
        for worker in workers.values():  # loads the side, then warms it up on its own prompts
            worker.submit(_run, prompts.make(2, 16), 4).result()
        rows = run_batches(args, workers, prompts)
    print(f"load average: {load_average()}")
    print("saved", save_result("bench_offline", {"args": vars(args), "rows": rows}))


def run_batches(args: argparse.Namespace, workers: dict[str, ProcessPoolExecutor],
                prompts: PromptMaker) -> list[dict[str, object]]:
    rows = []
    print(f"{'batch':>5} {'arbor tok/s':>12} {'hf tok/s':>10} {'ratio':>7}  (medians of {args.repeats}; "
          "each repeat's ratio, the two sides run back to back)")
    sides = list(workers)
    for batch in args.batches:
        runs: dict[str, list[float]] = {"arbor": [], "hf": []}
        for repeat in range(args.repeats):
            batch_prompts = prompts.make(batch, args.prompt_len)  # the same for both sides
            for side in sides if repeat % 2 == 0 else sides[::-1]:  # alternate who goes first
                runs[side].append(workers[side].submit(_run, batch_prompts, args.new_tokens).result())
        ours, theirs = runs["arbor"], runs["hf"]
        paired = [a / h for a, h in zip(ours, theirs, strict=False)]
        row = {"batch": batch, "arbor_tok_s": median(ours), "hf_tok_s": median(theirs),
               "arbor_runs": ours, "hf_runs": theirs, "repeat_ratios": paired,
               "load_average": load_average()}
        row["ratio"] = row["arbor_tok_s"] / row["hf_tok_s"]
        rows.append(row)
        print(f"{batch:>5} {row['arbor_tok_s']:>12.1f} {row['hf_tok_s']:>10.1f} {row['ratio']:>7.2f}x  "
              f"({' '.join(f'{r:.2f}' for r in paired)}; load {row['load_average']})", flush=True)
    return rows


if __name__ == "__main__":
    main()
