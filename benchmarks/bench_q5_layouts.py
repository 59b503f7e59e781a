"""Which 5-bit layout the CPU kernel multiplies fastest (Q5_0 / Q5_1 / Q5_K weights):
the 5-bit tiles (nibbles plus 64-bit masks of fifth bits), the 5-bit row layout, or the
codes widened to 8 bits and tiled (how Q5 was held before); 4-bit tiles as the floor.

Many distinct weights of one shape are streamed (more bytes than the caches), so a call
reads its weight from memory as decode does; the figure is the median time per weight.

    python benchmarks/bench_q5_layouts.py --shape 3072x576 --rows 1 8 --save bench_q5_layouts
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import load_average, median, save_result  # noqa: E402

from kernels.cpu.quant_linear import CpuQuantLinear  # noqa: E402
from kernels.reference import quant as Q  # noqa: E402

STREAM_BYTES = 256 << 20  # the weights streamed per layout: well past the last-level cache


def layouts(weight: torch.Tensor) -> dict[str, Q.QuantizedWeight]:
    five = Q.quantize_int5(weight)
    return {"5-bit tiles": Q.tile(five), "5-bit rows": five, "8-bit tiles (Q5 before)": Q.tile(Q.widen(five)),
            "4-bit tiles": Q.tile(Q.quantize_int4(weight))}


def measure(kernel: CpuQuantLinear, n: int, k: int, rows: list[int], repeats: int) -> list[dict[str, Any]]:
    base = torch.randn(n, k) * 0.05
    first = layouts(base)
    copies = {name: max(2, STREAM_BYTES // w.nbytes) for name, w in first.items()}
    results = []
    for name, w in first.items():
        # NOTE: distinct tensors of the same values: every call reads its weight from memory
        stream = [Q.QuantizedWeight(w.codes.clone(), w.scales.clone(), w.offsets.clone(), w.bits,
                                    w.blocks_per_group, w.in_features, w.tiled) for _ in range(copies[name])]
        for m in rows:
            x = torch.randn(m, k)
            for weight in stream[:2]:
                kernel(x, weight)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                for weight in stream:
                    kernel(x, weight)
                times.append((time.perf_counter() - start) / len(stream))
            us = median(times) * 1e6
            results.append({"layout": name, "shape": f"{n}x{k}", "rows": m, "us": round(us, 1),
                            "GB/s": round(w.nbytes / us / 1e3, 1), "bytes": w.nbytes})
            print(results[-1], flush=True)
        del stream
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help="NxK (repeatable); default 3072x576 and 576x1536")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/arbor-bench-kernels"))
    parser.add_argument("--save", help="results/<name>.json")
    args = parser.parse_args()
    print("command:", " ".join(sys.argv), "| load average", load_average(), "| threads", torch.get_num_threads())
    kernel = CpuQuantLinear(args.cache)
    rows: list[dict[str, Any]] = []
    for shape in args.shape or ["3072x576", "576x1536"]:
        n, k = (int(v) for v in shape.split("x"))
        rows += measure(kernel, n, k, args.rows, args.repeats)
    if args.save:
        save_result(args.save, {"title": "5-bit weight layouts in the CPU kernel (" + kernel.path + ")",
                                "summary": [f"median time per weight over distinct weights ({STREAM_BYTES >> 20} MiB "
                                            f"streamed), {torch.get_num_threads()} threads"],
                                "rows": rows})


if __name__ == "__main__":
    main()
