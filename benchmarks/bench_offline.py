"""Offline decode throughput: Arbor vs HF transformers `generate`, same weights, fp32.

Each batch size runs both systems in this one process on the same prompts (prompt 128
tokens, 128 new tokens, greedy, EOS ignored) and prints tokens/s and the ratio. HF loads
the converted default-model directory in fp32 with SDPA attention and generates one
left-padded batch.

    .venv/bin/python benchmarks/bench_offline.py [--batches 1 8 32 64] [--repeats 1] [--no-prepack]
        [--torch-kernels]

``--no-prepack`` runs Arbor with plain ``F.linear`` weights (``prepack_weights=False``),
the baseline for the oneDNN-prepacked linears; ``--torch-kernels`` runs attention, norms,
activation and rotary embedding on the torch reference instead of the native CPU kernels
(``kernels/cpu``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result, timed  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402


def make_prompts(tokenizer, batch: int, prompt_len: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    base = tokenizer("The history of the city goes back many centuries. " * 40)["input_ids"]
    return [base[i : i + prompt_len] for i in range(batch)]  # distinct prompts, no sharing


def run_arbor(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seconds, outs = timed(engine.generate, input_ids=prompts, sampling_params=params)
    assert all(len(o.token_ids) == new_tokens for o in outs)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--no-prepack", action="store_true", help="plain F.linear weights (the baseline)")
    ap.add_argument("--torch-kernels", action="store_true",
                    help="the torch reference ops instead of the native CPU kernels (their baseline)")
    ap.add_argument("--speculation", action="store_true",
                    help="leave prompt-lookup speculation on (off by default: this measures plain "
                         "decode, and the benchmark's repetitive prompts would flatter it)")
    args = ap.parse_args()
    print(reproduce_line())
    engine = Engine(model="default", page_size=16, speculation=args.speculation,
                    prepack_weights=not args.no_prepack)
    if args.torch_kernels:
        kernels.set_kernel_backend("torch")
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    run_arbor(engine, make_prompts(engine.tokenizer, 2, 16), 4)  # warm-up
    rows = []
    print(f"{'batch':>5} {'arbor tok/s':>12} {'hf tok/s':>10} {'ratio':>7}")
    for batch in args.batches:
        prompts = make_prompts(engine.tokenizer, batch, args.prompt_len)
        ours = median([run_arbor(engine, prompts, args.new_tokens) for _ in range(args.repeats)])
        theirs = float("nan")
        if hf is not None:
            theirs = median([run_hf(hf, engine.tokenizer.pad_token_id or 0, prompts, args.new_tokens)
                             for _ in range(args.repeats)])
        rows.append({"batch": batch, "arbor_tok_s": ours, "hf_tok_s": theirs, "ratio": ours / theirs})
        print(f"{batch:>5} {ours:>12.1f} {theirs:>10.1f} {ours / theirs:>7.2f}x", flush=True)
    print(f"load average: {load_average()}")
    print("saved", save_result("bench_offline", {"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
