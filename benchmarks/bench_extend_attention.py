"""Prefill ("extend") attention on the CPU: the row-invariant C kernel
(``kernels/cpu/extend_attention.c``) vs the torch path (one gather + torch's fused SDPA
kernel, ``kernels/reference/attention.py``), one layer's call each.

The default model's heads (9 query heads, 3 KV heads, head dim 64), fp32, page size 16
with pages in a scrambled order. Cases: a whole prompt of 512 and of 4096 tokens (no
prefix: the torch path's causal kernel, which skips the masked half); chunks of a chunked
prefill (a chunk over a long cached prefix: the torch path's masked kernel); a small chunk
and speculative verify rows (a few rows over a long prefix each); and a windowed,
soft-capped layer (Gemma 2's shape of call), where the torch path is the masked matmul
reference. The torch path's plan (slots, masks) is built once outside the timing, as the
engine builds it once per forward pass for every layer.

For every case, in this one process: outputs compared first (a mismatch stops the run),
then the median time of one call of both paths, interleaved, and the ratio.

``--engine``: end to end instead, the default model's time to first token for one prompt
alone (prefix cache off, one new token) with ``invariant_attention`` on (the C kernel)
and off (torch's SDPA), two engines in this process, runs interleaved.

    .venv/bin/python benchmarks/bench_extend_attention.py [--repeats 20] [--threads 2]
    .venv/bin/python benchmarks/bench_extend_attention.py --engine [--lens 512 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result, timed  # noqa: E402

from kernels.cpu import CpuKernels  # noqa: E402
from kernels.reference.attention import plan_extend, run_plan  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16
# (name, [(prefix, new tokens) per request], window, softcap)
CASES: list[tuple[str, list[tuple[int, int]], int | None, float | None]] = [
    ("prefill 512", [(0, 512)], None, None),
    ("prefill 4096", [(0, 4096)], None, None),
    ("chunk 512 after 1024", [(1024, 512)], None, None),
    ("chunk 512 after 3584", [(3584, 512)], None, None),
    ("chunk 64 after 2048", [(2048, 64)], None, None),
    ("verify 8 x 5 rows after 1000", [(1000, 5)] * 8, None, None),
    ("prefill 4 x 256", [(0, 256)] * 4, None, None),
    ("prefill 1024, window 256, cap 50", [(0, 1024)], 256, 50.0),
]


def make_case(reqs: list[tuple[int, int]], gen: torch.Generator) -> dict[str, Any]:
    pages = [-(-(p + e) // PAGE_SIZE) for p, e in reqs]
    width = max(pages)
    order = (torch.randperm(sum(pages), generator=gen) + 1).tolist()
    table = torch.zeros(len(reqs), width, dtype=torch.int32)
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    shape = ((1 + sum(pages)) * PAGE_SIZE, KV_HEADS, HEAD_DIM)
    ext = [e for _, e in reqs]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return {"q": torch.randn(sum(ext), HEADS, HEAD_DIM, generator=gen), "k": torch.randn(shape, generator=gen),
            "v": torch.randn(shape, generator=gen), "table": table, "prefix": i32([p for p, _ in reqs]),
            "ext": i32(ext), "indptr": i32([0, *torch.tensor(ext).cumsum(0).tolist()])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="case names to run (default: all)")
    ap.add_argument("--engine", action="store_true", help="end to end: time to first token, on vs off")
    ap.add_argument("--lens", type=int, nargs="+", default=[512, 4096])
    args = ap.parse_args()
    print(reproduce_line())
    if args.engine:
        return engine_main(args)
    torch.set_num_threads(args.threads)
    kernel = CpuKernels.build(Path(tempfile.gettempdir()) / "arbor-bench-kernels").extend_attention
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    rows = []
    for name, reqs, window, cap in CASES:
        if args.only and name not in args.only:
            continue
        c = make_case(reqs, gen)
        plan = plan_extend(c["table"], c["prefix"], c["ext"], c["indptr"], PAGE_SIZE, window=window)

        def torch_path(c: dict[str, Any] = c, plan: Any = plan, window: Any = window, cap: Any = cap) -> Any:
            return run_plan(c["q"], c["k"], c["v"], plan, scale, softcap=cap)

        def c_path(c: dict[str, Any] = c, window: Any = window, cap: Any = cap) -> Any:
            return kernel(c["q"], c["k"], c["v"], c["table"], c["prefix"], c["ext"], c["indptr"], PAGE_SIZE, scale,
                          window=window, softcap=cap)[0]

        torch.testing.assert_close(c_path(), torch_path(), atol=1e-4, rtol=1e-4)
        times: dict[str, list[float]] = {"torch": [], "c": []}
        for _ in range(args.repeats):  # NOTE: interleaved, so drifting load hits both alike
            times["torch"].append(timed(torch_path)[0])
            times["c"].append(timed(c_path)[0])
        t_torch, t_c = median(times["torch"]) * 1e3, median(times["c"]) * 1e3
        row = {"case": name, "torch_ms": round(t_torch, 3), "c_kernel_ms": round(t_c, 3),
               "c_over_torch": round(t_c / t_torch, 2)}
        rows.append(row)
        print(f"{name:36s} torch {t_torch:9.3f} ms   C {t_c:9.3f} ms   C/torch {t_c / t_torch:5.2f}", flush=True)
    print(f"load average: {load_average()}")
    if not args.only:
        save_result("extend_attention", {
            "title": "Prefill (extend) attention: row-invariant C kernel vs torch SDPA, one layer",
            "summary": [f"default model heads (9 q, 3 kv, dim 64), fp32, page size 16, {args.threads} threads; "
                        f"median of {args.repeats} interleaved calls each",
                        "torch: one gather + torch's fused CPU SDPA kernel (causal kernel without a prefix, "
                        "masked with one; windowed / capped: the masked matmul reference), plan built beforehand"],
            "rows": rows})


def engine_main(args: argparse.Namespace) -> None:
    from runtime import Engine, SamplingParams

    engines = {on: Engine(model="default", invariant_attention=on, disable_prefix_cache=True,
                          num_threads=args.threads, max_model_len=max(args.lens) + 8, seed=0) for on in (True, False)}
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, speculation=False)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for length in args.lens:
        ids = torch.randint(1000, 40000, (length,), generator=gen).tolist()
        times: dict[bool, list[float]] = {True: [], False: []}
        for on in (True, False):  # warm-up
            engines[on].generate(input_ids=[ids], sampling_params=params)
        for _ in range(args.repeats):
            for on in (True, False):
                times[on].append(timed(engines[on].generate, input_ids=[ids], sampling_params=params)[0])
        t_on, t_off = median(times[True]), median(times[False])
        rows.append({"prompt_tokens": length, "invariant_c_kernel_s": round(t_on, 3), "torch_sdpa_s": round(t_off, 3),
                     "c_over_torch": round(t_on / t_off, 2)})
        print(f"prompt {length:6d}: invariant (C) {t_on:7.3f} s   torch SDPA {t_off:7.3f} s   "
              f"ratio {t_on / t_off:5.2f}", flush=True)
    for engine in engines.values():
        engine.close()
    print(f"load average: {load_average()}")
    save_result("extend_attention_engine", {
        "title": "Time to first token, default model: invariant prefill attention (C kernel) vs torch SDPA",
        "summary": [f"one prompt alone, prefix cache off, one new token, {args.threads} threads; median of "
                    f"{args.repeats} interleaved runs; --invariant-attention vs --no-invariant-attention"],
        "rows": rows})


if __name__ == "__main__":
    main()
