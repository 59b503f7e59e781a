"""Prefill: time to the first token of one prompt alone, Arbor vs HF transformers.

For each prompt length, both systems run in this one process on the same token ids
(greedy, one new token, fp32): Arbor's ``generate`` with the prefix cache off (every run
computes the whole prompt), HF's ``generate`` on the same converted weights with SDPA
attention (which keeps only the last position's logits for one new token). Each time is
the median of ``--repeats`` runs after one warm-up; the ratio is HF's time over ours.

Arbor prefills a prompt that has no cached prefix in one pass when nothing else runs
(chunks only interleave with running decodes), and that pass's attention is plain causal:
``kernels.reference.attention`` hands it to torch's fused CPU kernel in causal mode.

    .venv/bin/python benchmarks/bench_prefill.py [--lens 128 512 2000] [--repeats 3] [--skip-hf]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result, timed  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402
from runtime.model.loader import resolve_model_dir  # noqa: E402


def prompt(tokenizer, length: int) -> list[int]:  # type: ignore[no-untyped-def]
    text = "The history of the city goes back many centuries, and its people kept records. "
    ids: list[int] = tokenizer(text * (length // 8 + 1))["input_ids"]
    return ids[:length]


def arbor_seconds(engine: Engine, ids: list[int]) -> float:
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, speculation=False)
    seconds, outs = timed(engine.generate, input_ids=[ids], sampling_params=params)
    assert len(outs[0].token_ids) == 1
    return seconds


def hf_seconds(model, ids: list[int]) -> float:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        seconds, out = timed(model.generate, input_ids=torch.tensor([ids]), do_sample=False,
                             max_new_tokens=1, min_new_tokens=1, pad_token_id=0)
    assert out.shape[1] == len(ids) + 1
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", type=int, nargs="+", default=[128, 512, 2000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    print(reproduce_line())
    engine = Engine(model="default", disable_prefix_cache=True, max_model_len=max(args.lens) + 16)
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("default")), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    rows = []
    print(f"{'tokens':>6} {'arbor s':>8} {'hf s':>8} {'ratio':>7}")
    for length in args.lens:
        ids = prompt(engine.tokenizer, length)
        arbor_seconds(engine, ids)  # warm-up
        ours = median([arbor_seconds(engine, ids) for _ in range(args.repeats)])
        theirs = float("nan")
        if hf is not None:
            hf_seconds(hf, ids)
            theirs = median([hf_seconds(hf, ids) for _ in range(args.repeats)])
        rows.append({"tokens": length, "arbor_s": ours, "hf_s": theirs, "ratio": theirs / ours})
        print(f"{length:>6} {ours:>8.3f} {theirs:>8.3f} {theirs / ours:>6.2f}x", flush=True)
    print(f"load average: {load_average()}")
    print("saved", save_result("bench_prefill", {"args": vars(args), "rows": rows}))
    engine.close()


if __name__ == "__main__":
    main()
