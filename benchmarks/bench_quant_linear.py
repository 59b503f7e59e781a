"""The quantized linear on the CPU: weights in tiles of 16 rows (the AVX-512 VNNI kernel's
layout, ``kernels.reference.quant.tile``) against the same weights in the row layout, in
one process, on the default model's shapes, at decode and prefill batch sizes.

Three sides per case, 2 threads (``--threads``), median of ``--repeats`` calls each:

- ``tiled``: the C kernel on the tiled weight (what an engine uses on AVX-512 VNNI);
- ``rows``: the C kernel on the row layout (tiling switched off);
- ``large-batch``: the path a row-layout weight takes past ``quant_kernel_max_rows``: the
  weight dequantized in one C pass to bf16 for oneDNN's matmul (AVX512_BF16) or to fp32
  for ``F.linear`` (elsewhere), timed at every size for comparison.

Outputs are compared first (tiled equals rows up to summation order, and both the
reference on int8-rounded activations); a mismatch stops the run. A case repeats one weight, so at batch 1 a weight
of a few MB is read partly from cache: the memory-bound batch-1 figure is
``bench_quant.py``'s end-to-end decode (the README has it before and after tiling).

    .venv/bin/python benchmarks/bench_quant_linear.py [--rows 1 32 256 1024] [--repeats 15]
        [--formats int8 q4] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, reproduce_line, save_result, time_call  # noqa: E402

from kernels.cpu.quant_linear import CpuQuantLinear  # noqa: E402
from kernels.reference import quant as Q  # noqa: E402

# [N, K] of the default model's linears: fused q/k/v, o, fused gate/up, down, the LM head
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
FORMATS: dict[str, Callable[[torch.Tensor], Q.QuantizedWeight]] = {
    "int8": lambda w: Q.quantize_int8(w),  # per channel, as weights="int8"
    "q4": lambda w: Q.quantize_int4(w),  # groups of 32, Q4_1's arithmetic, as weights="int4"/"gguf"
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256, 1024])
    parser.add_argument("--formats", nargs="+", choices=sorted(FORMATS), default=sorted(FORMATS))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(reproduce_line())
    torch.set_num_threads(args.threads)
    kernel = CpuQuantLinear(Path(tempfile.mkdtemp(prefix="arbor-bench-")))
    if not kernel.tiles:
        print(f"this CPU's kernel ({kernel.path}) has no AVX-512 VNNI path: it reads the row layout only, "
              "and there is no tiled side to measure")
        return
    large = "bf16 matmul" if kernel.has_bf16 else "fp32 F.linear"
    print(f"kernel: {kernel.path}; large-batch path: dequantize + {large}; {args.threads} threads, "
          f"medians of {args.repeats}")
    print(f"{'format':>6} {'weight':>8} {'rows':>5} {'tiled ms':>9} {'rows ms':>9} {'large ms':>9} "
          f"{'rows/tiled':>10} {'large/tiled':>11}")
    gen = torch.Generator().manual_seed(0)
    results = []
    for fmt in args.formats:
        for name, (n, k) in SHAPES.items():
            weight = FORMATS[fmt](torch.randn(n, k, generator=gen) * 0.05)
            tiled = Q.tile(weight)
            for rows in args.rows:
                x = torch.randn(rows, k, generator=gen)
                got, base = kernel(x, tiled), kernel(x, weight)
                torch.testing.assert_close(got, base, atol=1e-4, rtol=1e-4)  # summation order only
                want = Q.quantized_linear(Q.quantize_activations(x), weight)
                # NOTE: not elementwise: an activation landing on a rounding tie may round the
                # other way in C than in torch (seen: one row in 512, 3e-3 off)
                assert ((got - want).norm() / want.norm()).item() < 1e-4

                def large_batch(x: torch.Tensor = x, weight: Q.QuantizedWeight = weight) -> torch.Tensor:
                    if kernel.has_bf16:
                        return Q.bf16_linear(x, kernel.dequantize(weight, torch.bfloat16))
                    return F.linear(x, kernel.dequantize(weight))

                t_tiled = time_call(lambda: kernel(x, tiled), args.repeats)  # noqa: B023
                t_rows = time_call(lambda: kernel(x, weight), args.repeats)  # noqa: B023
                t_large = time_call(large_batch, max(3, args.repeats // 3))
                results.append({"format": fmt, "weight": name, "n": n, "k": k, "rows": rows,
                                "tiled_ms": 1e3 * t_tiled, "rows_ms": 1e3 * t_rows, "large_ms": 1e3 * t_large})
                print(f"{fmt:>6} {name:>8} {rows:>5} {1e3 * t_tiled:>9.3f} {1e3 * t_rows:>9.3f} "
                      f"{1e3 * t_large:>9.3f} {t_rows / t_tiled:>9.2f}x {t_large / t_tiled:>10.2f}x", flush=True)
    print(f"load average: {load_average()}")
    print(f"saved {save_result('bench_quant_linear', {'kernel': kernel.path, 'large_path': large, 'cases': results})}")


if __name__ == "__main__":
    main()
