"""KV cache in int8 / fp8 vs the model's fp32: capacity, kernel time, decode speed.

1. Capacity (arithmetic, no timing): bytes per token and how many 1,024-token sequences a
   1 GiB pool holds, default model (30 layers, 3 KV heads of 64 dims).
2. The native CPU decode-attention kernel over an fp32 / int8 / fp8 pool (default model's
   heads, page size 16, scrambled pages): median time of one call and the ratio to fp32.
3. End to end, default model, in this one process: an fp32-KV engine and an int8-KV engine
   (the baseline and the candidate, same settings otherwise) decode greedy tokens after
   long distinct prompts, alternating A/B runs; median tok/s of each and the ratio. The
   prompts are prefilled once before timing (the prefix cache keeps them), so a timed run
   is a one-token prefill and ``--tokens`` decode steps.

    .venv/bin/python benchmarks/bench_kv_quant.py [--batches 1 16] [--prompt-len 1000]
        [--tokens 32] [--repeats 3] [--lens 1024 4096]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result, time_call  # noqa: E402

from kernels import quantize_kv  # noqa: E402
from kernels.cpu import CpuKernels  # noqa: E402
from runtime.model.kv_cache import KVCache  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 9, 3, 64, 16
KV_DTYPES = {"fp32": torch.float32, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def capacity() -> dict[str, Any]:
    out = {}
    for name, dtype in KV_DTYPES.items():
        per_token = KVCache.bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, dtype)
        out[name] = {"bytes_per_token": per_token, "seqs_1024_per_gib": (1 << 30) // per_token // 1024}
        print(f"{name:5} {per_token:6d} bytes/token, {out[name]['seqs_1024_per_gib']:4d} sequences of "
              f"1,024 tokens per GiB ({out[name]['seqs_1024_per_gib'] / out['fp32']['seqs_1024_per_gib']:.2f}x)")
    return out


def kernel_times(batches: list[int], lens: list[int]) -> list[dict[str, Any]]:
    decode = CpuKernels.build(Path(tempfile.mkdtemp())).decode_attention
    rows = []
    for batch in batches:
        for seq_len in lens:
            pages = seq_len // PAGE_SIZE
            perm = torch.randperm(batch * pages) + 1
            table = perm.view(batch, pages).to(torch.int32)
            lens_t = torch.full((batch,), seq_len, dtype=torch.int32)
            shape = ((batch * pages + 1) * PAGE_SIZE, KV_HEADS, HEAD_DIM)
            k, v = torch.randn(shape), torch.randn(shape)
            q = torch.randn(batch, HEADS, HEAD_DIM)
            times = {}
            for name, dtype in KV_DTYPES.items():
                if dtype == torch.float32:
                    args: tuple[Any, ...] = (k, v, None, None)
                else:
                    (kq, ks), (vq, vs) = quantize_kv(k, dtype), quantize_kv(v, dtype)
                    args = (kq, vq, ks, vs)
                call = (q, args[0], args[1], table, lens_t, PAGE_SIZE, 0.125, args[2], args[3])
                times[name] = time_call(lambda c=call: decode(*c), 20)
            row = {"batch": batch, "seq_len": seq_len, **{f"{n}_us": t * 1e6 for n, t in times.items()}}
            rows.append(row)
            print(f"decode kernel B={batch:3d} L={seq_len:5d}: " + ", ".join(
                f"{n} {t * 1e6:8.0f} us ({times['fp32'] / t:.2f}x)" for n, t in times.items()))
    return rows


def decode_speed(batches: list[int], prompt_len: int, tokens: int, repeats: int) -> list[dict[str, Any]]:
    from runtime import Engine, SamplingParams

    common = {"page_size": PAGE_SIZE, "num_pages": 16384, "speculation": False}
    engines = {name: Engine("default", kv_cache_dtype=name, **common) for name in ("auto", "int8")}
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in batches:
        prompts = [[1] + [(7 * i + 13 * j) % 40000 + 100 for j in range(prompt_len - 1)] for i in range(batch)]
        for engine in engines.values():  # prefill once: timed runs reuse the cached prompt
            _seconds(engine, prompts, SamplingParams(max_new_tokens=1, temperature=0.0))
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():  # alternating A/B
                rates[name].append(batch * tokens / _seconds(engine, prompts, params))
        row = {"batch": batch, "prompt_len": prompt_len, "loadavg": load_average(),
               **{f"{n}_tok_s": median(r) for n, r in rates.items()}}
        rows.append(row)
        print(f"decode B={batch:3d} after {prompt_len} tokens: fp32 KV {row['auto_tok_s']:.1f} tok/s, "
              f"int8 KV {row['int8_tok_s']:.1f} tok/s ({row['int8_tok_s'] / row['auto_tok_s']:.2f}x); "
              f"runs fp32 {[round(x, 1) for x in rates['auto']]} int8 {[round(x, 1) for x in rates['int8']]}; "
              f"load {load_average()}")
    for engine in engines.values():
        engine.close()
    return rows


def _seconds(engine: Any, prompts: list[list[int]], params: Any) -> float:
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--skip-engine", action="store_true", help="capacity and kernel only")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(reproduce_line())
    print(f"load average at start: {load_average()}")
    result: dict[str, Any] = {"capacity": capacity(), "kernel": kernel_times(args.batches, args.lens)}
    if not args.skip_engine:
        result["decode"] = decode_speed(args.batches, args.prompt_len, args.tokens, args.repeats)
    print(f"saved {save_result('bench_kv_quant', result)}")


if __name__ == "__main__":
    main()
