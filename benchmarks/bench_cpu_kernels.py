"""The native CPU kernels (``kernels/cpu``) vs the torch reference, one call each.

Decode attention: the default model's heads (9 query heads, 3 KV heads, head dim 64),
fp32, page size 16 with pages handed out in a scrambled order; each request's length is
drawn from [L/2, L] so the reference pads and masks as it does in serving. The kernel's
K+V bytes read per second are printed beside (about 15 GB/s is this 2-core machine's rate
for 12 KB runs scattered over DRAM; L3-resident cases run faster).

Elementwise ops at the default model's widths (hidden 576, intermediate 1536) for a
decode batch (32 rows) and a prefill chunk (512 rows): residual add + RMSNorm,
SiLU-and-mul, rotary embedding of the q and k heads of a fused qkv row.

For every case, in this one process: outputs are compared first (a mismatch stops the
run), then the median time of one call of both paths and the ratio. End to end:
``bench_offline.py --torch-kernels`` is the baseline.

    .venv/bin/python benchmarks/bench_cpu_kernels.py [--batches 1 8 32 64] [--lens 128 256 1024]
        [--rows 32 512]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, reproduce_line, save_result, time_call  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.cpu import CpuKernels  # noqa: E402
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
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    print(reproduce_line())
    with tempfile.TemporaryDirectory() as cache:
        built = CpuKernels.build(Path(cache))
    rows = attention_rows(built, args)
    rows += elementwise_rows(built, args)
    print(f"load average: {load_average()}")
    print("saved", save_result("bench_cpu_kernels", {"args": vars(args), "rows": rows}))


def attention_rows(built: CpuKernels, args: argparse.Namespace) -> list[dict[str, object]]:
    native = built.decode_attention
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    print(f"decode attention\n{'batch':>5} {'len':>5} {'torch ms':>9} {'native ms':>10} {'ratio':>6} "
          f"{'native GB/s':>12}")
    rows: list[dict[str, object]] = []
    for batch in args.batches:
        for max_len in args.lens:
            q, k, v, table, lens = make_case(batch, max_len, gen)
            plan = plan_decode(table, lens, PAGE_SIZE)  # built once per forward in serving
            ours, _ = native(q, k, v, table, lens, PAGE_SIZE, scale)
            torch.testing.assert_close(ours, run_plan(q, k, v, plan, scale), atol=1e-5, rtol=1e-5)
            slow = time_call(lambda: run_plan(q, k, v, plan, scale), args.repeats)  # noqa: B023
            fast = time_call(lambda: native(q, k, v, table, lens, PAGE_SIZE, scale), args.repeats)  # noqa: B023
            gbps = int(lens.sum()) * 2 * KV_HEADS * HEAD_DIM * 4 / fast / 1e9
            rows.append({"op": "decode_attention", "batch": batch, "len": max_len, "torch_ms": 1e3 * slow,
                         "native_ms": 1e3 * fast, "ratio": slow / fast, "native_gbps": gbps})
            print(f"{batch:>5} {max_len:>5} {1e3 * slow:>9.3f} {1e3 * fast:>10.3f} {slow / fast:>5.2f}x "
                  f"{gbps:>12.1f}", flush=True)
    return rows


def elementwise_cases(built: CpuKernels, n: int, gen: torch.Generator) -> dict[str, tuple[Any, Any]]:
    """op -> (torch reference call, native call) on ``n`` rows of the default model's widths."""
    native = built.elementwise
    x, residual = torch.randn(n, 576, generator=gen), torch.randn(n, 576, generator=gen)
    weight, gate_up = torch.randn(576, generator=gen), torch.randn(n, 2 * 1536, generator=gen)
    qkv = torch.randn(n, 15 * 64, generator=gen)  # 9 q heads, 3 k heads, 3 v heads
    angles = torch.randn(n, 1, 32, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    qk = qkv[:, : 12 * 64].view(n, 12, 64)

    def native_norm() -> torch.Tensor:
        done = native.add_rms_norm(x, residual.clone(), weight, 1e-5)
        assert done is not None
        return done[0]

    return {
        "add_rms_norm": (lambda: reference.add_rms_norm(x, residual, weight, 1e-5)[0], native_norm),
        "silu_and_mul": (lambda: reference.silu_and_mul(gate_up), lambda: native.silu_and_mul(gate_up)),
        "apply_rotary": (lambda: reference.apply_rotary(qk, cos, sin), lambda: native.apply_rotary(qk, cos, sin)),
    }


def elementwise_rows(built: CpuKernels, args: argparse.Namespace) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(1)
    print(f"elementwise\n{'op':>14} {'rows':>5} {'torch us':>9} {'native us':>10} {'ratio':>6}")
    rows: list[dict[str, object]] = []
    for n in args.rows:
        cases = elementwise_cases(built, n, gen)
        for op in ("add_rms_norm", "silu_and_mul"):  # rotary is checked by tests/kernels
            torch.testing.assert_close(cases[op][1](), cases[op][0](), atol=1e-5, rtol=1e-5)
        for op, (slow_fn, fast_fn) in cases.items():
            slow, fast = time_call(slow_fn, args.repeats), time_call(fast_fn, args.repeats)
            rows.append({"op": op, "rows": n, "torch_us": 1e6 * slow, "native_us": 1e6 * fast,
                         "ratio": slow / fast})
            print(f"{op:>14} {n:>5} {1e6 * slow:>9.1f} {1e6 * fast:>10.1f} {slow / fast:>5.2f}x", flush=True)
    return rows


if __name__ == "__main__":
    main()
