"""Paged decode attention on the CPU: the native C kernel vs the torch reference.

The default model's heads (9 query heads, 3 KV heads, head dim 64), fp32, page size 16
with pages handed out in a scrambled order; each request's length is drawn from
[L/2, L] so the reference pads and masks as it does in serving. For every batch size and
context, in this one process: the outputs are compared first (a mismatch stops the run),
then the median time of one call (one layer) of both paths and the ratio; the kernel's
K+V bytes read per second are printed beside. End to end: ``bench_offline.py`` (its
``--torch-attention`` is the baseline).

    .venv/bin/python benchmarks/bench_cpu_attention.py [--batches 1 8 32 64] [--lens 128 256 1024]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, reproduce_line, save_result, time_call  # noqa: E402

from kernels.cpu import CpuDecodeAttention  # noqa: E402
from kernels.reference.attention import plan_decode, run_plan  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16


def make_case(batch: int, max_len: int, gen: torch.Generator):  # type: ignore[no-untyped-def]
    lens = torch.randint(max_len // 2, max_len + 1, (batch,), generator=gen, dtype=torch.int32)
    lens[0] = max_len
    max_pages = -(-max_len // PAGE_SIZE)
    num_pages = 1 + batch * max_pages
    table = (torch.randperm(batch * max_pages, generator=gen) + 1).view(batch, max_pages).int()
    shape = (num_pages * PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    return q, k, v, table, lens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--lens", type=int, nargs="+", default=[128, 256, 1024])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    print(reproduce_line())
    with tempfile.TemporaryDirectory() as cache:
        native = CpuDecodeAttention(Path(cache))
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    print(f"{'batch':>5} {'len':>5} {'torch ms':>9} {'native ms':>10} {'ratio':>6} {'native GB/s':>12}")
    rows = []
    for batch in args.batches:
        for max_len in args.lens:
            q, k, v, table, lens = make_case(batch, max_len, gen)
            plan = plan_decode(table, lens, PAGE_SIZE)  # built once per forward in serving
            ours, _ = native(q, k, v, table, lens, PAGE_SIZE, scale)
            torch.testing.assert_close(ours, run_plan(q, k, v, plan, scale), atol=1e-5, rtol=1e-5)
            slow = time_call(lambda: run_plan(q, k, v, plan, scale), args.repeats)  # noqa: B023
            fast = time_call(lambda: native(q, k, v, table, lens, PAGE_SIZE, scale), args.repeats)  # noqa: B023
            gbps = int(lens.sum()) * 2 * KV_HEADS * HEAD_DIM * 4 / fast / 1e9
            rows.append({"batch": batch, "len": max_len, "torch_ms": 1e3 * slow, "native_ms": 1e3 * fast,
                         "ratio": slow / fast, "native_gbps": gbps})
            print(f"{batch:>5} {max_len:>5} {1e3 * slow:>9.3f} {1e3 * fast:>10.3f} {slow / fast:>5.2f}x "
                  f"{gbps:>12.1f}", flush=True)
    print(f"load average: {load_average()}")
    print("saved", save_result("bench_cpu_attention", {"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
