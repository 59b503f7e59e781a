"""A mixture-of-experts feed-forward stack against its dense-equivalent compute.

A small random MoE (default: 8 experts, top-2, hidden 1024, 512 intermediate features per
expert) over ``--layers`` layers, each layer's block run on the same batch of tokens (batch
1: decode of one stream; 32: a decode batch), against a dense SwiGLU MLP with the same
active parameters per token (intermediate = top_k x the expert's). Per weight format
(fp32, int8, int4) and batch, prints the median time of one pass over the stack for:

    moe       ``SparseMoeBlock`` as the engine runs it (router, grouping, the experts
              through ``kernels.moe_experts``: the C kernel for quantized weights)
    loop      the same experts one expert at a time through ``quantized_linear`` /
              ``F.linear`` and ``silu_and_mul`` (the dispatcher's fallback), quantized only
    dense     the dense-equivalent MLP (oneDNN-prepacked in fp32, the C kernel quantized)

Sides are interleaved within each repeat. The weights of all layers are distinct, so a pass
streams them from memory as decoding does. CPU; ``--threads`` (default torch's count): on a
machine shared with other jobs, OpenMP barriers of 2 threads wait on descheduled threads,
and 1 thread gives steadier figures.

    .venv/bin/python benchmarks/bench_moe.py [--layers 8] [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result  # noqa: E402

import kernels  # noqa: E402
from kernels import dispatch  # noqa: E402
from kernels.onednn import PackedLinear  # noqa: E402
from kernels.reference.moe import combine, grouped_experts  # noqa: E402
from runtime import env  # noqa: E402
from runtime.model.moe import MoEArgs, SparseMoeBlock  # noqa: E402
from runtime.model.quant import FORMATS, QuantizedLinear  # noqa: E402

Layer = Callable[[torch.Tensor], torch.Tensor]


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj: nn.Module = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj: nn.Module = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


def _moe_stack(args: argparse.Namespace, fmt: str) -> list[SparseMoeBlock]:
    moe = MoEArgs(args.experts, args.top_k, args.inter, normalize_topk=True)
    blocks = []
    for _ in range(args.layers):
        block = SparseMoeBlock(args.hidden, moe)
        for p in block.parameters():
            nn.init.normal_(p, std=0.02)
        if fmt != "fp32":
            block.quantize(FORMATS[fmt].linear)
            block.convert_quantized(kernels.prepare_quantized)
        blocks.append(block.eval())
    return blocks


def _dense_stack(args: argparse.Namespace, fmt: str) -> list[DenseMLP]:
    mlps = []
    for _ in range(args.layers):
        mlp = DenseMLP(args.hidden, args.top_k * args.inter)
        for p in mlp.parameters():
            nn.init.normal_(p, std=0.02)
        for name in ("gate_up_proj", "down_proj"):
            linear = getattr(mlp, name)
            if fmt == "fp32":
                setattr(mlp, name, PackedLinear.from_linear(linear))
            else:
                weight = kernels.prepare_quantized(FORMATS[fmt].linear(linear.weight.detach()))
                setattr(mlp, name, QuantizedLinear(weight))
        mlps.append(mlp.eval())
    return mlps


def _loop(block: SparseMoeBlock) -> Layer:
    """The block with its experts run one expert at a time (the dispatcher's fallback)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        weights, ids = kernels.route_topk(block.gate(x), block.args.top_k, block.args.normalize_topk)
        groups = kernels.group_by_expert(weights, ids, block.args.num_experts)
        rows = grouped_experts(x.index_select(0, groups.token_idx), groups.offsets, block.experts(),
                               dispatch._expert_linear, dispatch.silu_and_mul)
        return combine(rows, groups)

    return run


def _time_stacks(stacks: dict[str, list[Layer]], x: torch.Tensor, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in stacks}
    with torch.inference_mode():
        for rep in range(repeats + 1):  # the first pass warms up
            for name, layers in stacks.items():
                start = time.perf_counter()
                for layer in layers:
                    layer(x)
                if rep:
                    times[name].append(time.perf_counter() - start)
    return {name: median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512, help="intermediate features per expert")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--formats", nargs="+", default=["fp32", "int8", "int4"], choices=["fp32", "int8", "int4"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    kernels.enable_cpu_kernels(env.cache_dir() / "kernels")
    print(reproduce_line())
    print(f"{'format':>6} {'batch':>5} {'moe ms':>8} {'loop ms':>8} {'dense ms':>9} {'moe/dense':>9} {'loop/moe':>8}")
    rows = []
    for fmt in args.formats:
        blocks, dense = _moe_stack(args, fmt), _dense_stack(args, fmt)
        stacks: dict[str, list[Layer]] = {"moe": list(blocks), "dense": list(dense)}
        if fmt != "fp32":
            stacks["loop"] = [_loop(b) for b in blocks]
        for batch in args.batches:
            x = torch.randn(batch, args.hidden, generator=torch.Generator().manual_seed(batch))
            t = _time_stacks(stacks, x, args.repeats)
            loop = t.get("loop", float("nan"))
            row = {"format": fmt, "batch": batch, "moe_ms": 1e3 * t["moe"], "loop_ms": 1e3 * loop,
                   "dense_ms": 1e3 * t["dense"], "moe_over_dense": t["moe"] / t["dense"], "loop_over_moe": loop / t["moe"]}
            rows.append(row)
            print(f"{fmt:>6} {batch:>5} {row['moe_ms']:>8.3f} {row['loop_ms']:>8.3f} {row['dense_ms']:>9.3f} "
                  f"{row['moe_over_dense']:>8.2f}x {row['loop_over_moe']:>7.2f}x", flush=True)
        del blocks, dense, stacks
    print(f"load average: {load_average()}")
    shape = (f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, {args.inter} per expert, "
             f"{args.layers} layers")
    summary = [f"{shape}; dense-equivalent: intermediate {args.top_k * args.inter} (the same active parameters).",
               "moe: the engine's block (C experts kernel for quantized weights); loop: one expert at a time "
               "through quantized_linear; times are one pass over the stack, median, sides interleaved."]
    print("saved", save_result("bench_moe", {"title": "Mixture of experts vs dense-equivalent compute",
                                             "summary": summary, "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
