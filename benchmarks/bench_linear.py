"""One linear layer: oneDNN-prepacked weight vs ``F.linear`` on the default model's shapes.

For each weight shape of SmolLM2-135M (the tied LM head, fused q/k/v, fused gate/up, down)
and a row count (1 and 32: decode batches; 2048: a prefill step), prints the median time of
one call for both paths and the ratio. fp32 on the CPU, torch's default thread count. The
end-to-end effect is in ``benchmarks/bench_offline.py`` (``--no-prepack`` is the baseline).

    .venv/bin/python benchmarks/bench_linear.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, reproduce_line, save_result, time_call  # noqa: E402

from kernels import onednn  # noqa: E402

SHAPES = {"lm_head": (49152, 576), "qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 2048])
    args = ap.parse_args()
    if not onednn.available():
        sys.exit("this torch build has no oneDNN: nothing to compare")
    print(reproduce_line())
    print(f"{'weight':>8} {'shape':>12} {'rows':>5} {'F.linear ms':>12} {'packed ms':>10} {'ratio':>6}")
    rows = []
    for name, shape in SHAPES.items():
        weight = torch.randn(*shape)
        packed = onednn.PackedLinear(weight)
        for m in args.rows:
            x = torch.randn(m, shape[1])
            plain = time_call(lambda: F.linear(x, weight), args.repeats)  # noqa: B023
            fast = time_call(lambda: packed(x), args.repeats)  # noqa: B023
            rows.append({"weight": name, "shape": shape, "rows": m, "f_linear_ms": 1e3 * plain,
                         "packed_ms": 1e3 * fast, "ratio": plain / fast})
            print(f"{name:>8} {str(shape):>12} {m:>5} {1e3 * plain:>12.3f} {1e3 * fast:>10.3f} "
                  f"{plain / fast:>5.2f}x", flush=True)
    print(f"load average: {load_average()}")
    print("saved", save_result("bench_linear", {"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
