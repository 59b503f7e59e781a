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

``--engine``: the same comparison end to end. A random Mixtral (hidden 512, 8 layers, 8
experts of 1024, top-2, tied embeddings, the default model's tokenizer) and the Mistral of
the same shape with one MLP of 2048 (the same active parameters), each served by an
``Engine`` (fp32 and int4), decoding ``--new-tokens`` tokens after an 8-token prompt for
each of a batch of 1 or 32 requests; prints tokens/s (prefill included), sides interleaved.

``--llama-env FILE``: against llama.cpp on the same GGUF. ``bench_scale.py``'s random
Mixtral-style file (``--shape moe``: hidden 2048, 8 layers, 8 experts of 2048, top-2, in
llama.cpp's stacked ``*_exps`` layout; ``--type`` Q4_0 or Q8_0), both engines on it through
``bench_scale``'s interleaved runner: decode at 1 / 8 / 32 streams, prefill of 512 tokens,
start to first token and peak RSS, each side's median, ratios Arbor / llama.cpp.

    .venv/bin/python benchmarks/bench_moe.py --llama-env llama.cpp-build/llama.cpp.env --type Q4_0
"""


from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _save_models(out: Path, experts: int, top_k: int) -> dict[str, Path]:
    """The random Mixtral and its dense-equivalent Mistral as HF directories."""
    import shutil

    from transformers import MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

    from runtime.model.default_model import default_model_dir

    common: dict[str, Any] = dict(vocab_size=49152, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
                  sliding_window=None, bos_token_id=1, eos_token_id=2)
    models = {"moe": (MixtralForCausalLM, MixtralConfig(**common, intermediate_size=1024, num_local_experts=experts,
                                                        num_experts_per_tok=top_k)),
              "dense": (MistralForCausalLM, MistralConfig(**common, intermediate_size=1024 * top_k))}
    dirs = {}
    for name, (cls, cfg) in models.items():
        torch.manual_seed(0)
        model = cls(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.05)
        dirs[name] = out / name
        model.save_pretrained(dirs[name], safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (default_model_dir() / f).is_file():
                shutil.copy(default_model_dir() / f, dirs[name] / f)
        del model
    return dirs


def engine_main(args: argparse.Namespace) -> None:
    import tempfile

    from runtime import Engine, SamplingParams

    print(reproduce_line())
    engines = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = _save_models(Path(tmp), args.experts, args.top_k)
        for fmt in args.formats:
            for name, path in dirs.items():
                engines[(fmt, name)] = Engine(model=str(path), weights=fmt, num_pages=4096, page_size=16,
                                              disable_prefix_cache=True, speculation=False)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rng = torch.Generator().manual_seed(0)
    print(f"{'format':>6} {'batch':>5} {'moe tok/s':>10} {'dense tok/s':>12} {'dense/moe':>9}")
    rows = []
    try:
        for fmt in args.formats:
            for batch in args.batches:
                times: dict[str, list[float]] = {"moe": [], "dense": []}
                for rep in range(args.repeats + 1):  # the first round warms up
                    prompts = torch.randint(1000, 40000, (batch, 8), generator=rng).tolist()
                    for name in times:
                        start = time.perf_counter()
                        outs = engines[(fmt, name)].generate(input_ids=prompts, sampling_params=params)
                        elapsed = time.perf_counter() - start
                        assert all(len(o.token_ids) == args.new_tokens for o in outs)
                        if rep:
                            times[name].append(batch * args.new_tokens / elapsed)
                moe, dense = median(times["moe"]), median(times["dense"])
                rows.append({"format": fmt, "batch": batch, "moe_tok_s": moe, "dense_tok_s": dense,
                             "dense_over_moe": dense / moe})
                print(f"{fmt:>6} {batch:>5} {moe:>10.1f} {dense:>12.1f} {dense / moe:>8.2f}x", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    print(f"load average: {load_average()}")
    summary = [f"Random Mixtral (hidden 512, 8 layers, {args.experts} experts of 1024, top-{args.top_k}, tied "
               f"embeddings) vs the Mistral with one MLP of {1024 * args.top_k} (same active parameters); "
               f"{args.new_tokens} new tokens after 8-token prompts, tokens/s with prefill, medians of "
               f"{args.repeats}, sides interleaved, {args.threads} thread(s)."]
    print("saved", save_result("bench_moe_engine", {"title": "Mixture of experts end to end: Engine decode vs "
                                                    "the dense-equivalent model", "summary": summary,
                                                    "args": vars(args), "rows": rows}))


def llama_main(args: argparse.Namespace) -> None:
    """The MoE file against llama.cpp: bench_scale's runner on its ``moe`` shape."""
    import bench_scale

    shape = bench_scale.SHAPES["moe"]
    streams = args.batches or [1, 8, 32]
    title = (f"Mixture of experts against llama.cpp on one GGUF: {shape.experts} experts, top-{shape.experts_used}, "
             f"{args.type}")
    bench_scale.main(["--shape", "moe", "--type", args.type, "--dir", str(args.dir), "--llama-env",
                      str(args.llama_env), "--rounds", str(args.rounds), "--threads", str(args.threads or 2),
                      "--streams", *map(str, streams), "--prefill", "512",
                      "--name", f"bench_moe_llama_cpp_{args.type}", "--title", title])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512, help="intermediate features per expert")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="batches (default 1 32; with "
                    "--llama-env: decode streams, default 1 8 32)")
    ap.add_argument("--formats", nargs="+", default=["fp32", "int8", "int4"], choices=["fp32", "int8", "int4"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    ap.add_argument("--engine", action="store_true", help="end to end: Engine decode of two random models")
    ap.add_argument("--new-tokens", type=int, default=32, help="--engine: tokens decoded per request")
    ap.add_argument("--llama-env", type=Path, default=None, help="against llama.cpp on one GGUF: the env file "
                    "benchmarks/peers/build_llama_cpp.sh wrote")
    ap.add_argument("--type", choices=["Q4_0", "Q8_0"], default="Q4_0", help="--llama-env: the file's blocks")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/arbor-bench-scale"), help="--llama-env: where the "
                    "file is (written when missing)")
    ap.add_argument("--rounds", type=int, default=2, help="--llama-env: rounds, sides alternated")
    args = ap.parse_args()
    if args.llama_env is not None:
        llama_main(args)
        return
    args.batches = args.batches or [1, 32]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    if args.engine:
        engine_main(args)
        return
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
