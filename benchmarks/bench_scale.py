"""Engine against engine on random-weight GGUF files of real shapes: Arbor and llama.cpp
on the same file, interleaved.

    .venv/bin/python benchmarks/bench_scale.py --shape 1b --type Q4_0 --rounds 2 \\
        --llama-env llama.cpp-build/llama.cpp.env

Writes a Llama of the chosen shape straight with the ``gguf`` writer, tensor by tensor, in
random blocks of the chosen type (random codes, fp16 scales of a sane size, F32 norms; the
default model's tokenizer, whose 49,152-token vocabulary the 1B shape shares, padded with
reserved tokens for the 8B shape's) -- no f16 intermediate. "Q4_K_M" mixes types as
llama-quantize does for it: Q6_K for the output head and for attn_v and ffn_down in a third
of the layers (more at both ends), Q4_K elsewhere. The ``moe`` shape is a Mixtral-style
file (llama architecture with 8 experts, top-2, in llama.cpp's stacked ``*_exps`` layout).

Then per round, each side in turn (who goes first flips every round), on the same file
with the same thread count:

- a cold start (the file's pages dropped from the page cache first) and a warm one, timed
  from process start to the first generated token, with the process's peak RSS;
- llama.cpp: ``llama-bench`` (prefill of each ``--prefill`` length, one stream decoding
  ``--gen`` tokens) and ``llama-batched-bench`` (``--streams`` sequences of ``--prompt``
  tokens each, then ``--gen`` decode steps of all of them: decode-only tokens/s);
- Arbor, through its public API (``Engine(weights="gguf", speculation=False)``) in one
  process: the same decode counts (decode-only: a run of ``1 + gen`` tokens minus a run of
  1 token on other prompts of the same length) and the prefill of each length (one new
  token), distinct prompts everywhere.

The text such a model writes is noise; only speed and memory are real. Without
``--llama-env`` only Arbor runs. Results go to ``benchmarks/results/bench_scale_<shape>_<type>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from common import RESULTS, load_average, median, reproduce_line, save_result  # noqa: E402
from peer_llama import (  # noqa: E402
    LlamaTools,
    batched_command,
    bench_command,
    evict_from_page_cache,
    first_token_command,
    parse_batched_bench,
    parse_llama_bench,
    run_process,
)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int  # per expert where there are experts
    vocab: int
    experts: int = 0
    experts_used: int = 0


SHAPES = {
    "1b": Shape(2048, 16, 32, 8, 8192, 49152),
    "8b": Shape(4096, 32, 32, 8, 14336, 128256),  # Llama 3 8B's layer shape
    "moe": Shape(2048, 8, 16, 4, 2048, 49152, experts=8, experts_used=2),  # Mixtral-style, ~0.9B
}


def q4_0_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks ``[rows, cols / 32 * 18]``: fp16 d ~ 0.01, random nibbles."""
    nb = cols // 32
    blocks = np.empty((rows, nb, 18), dtype=np.uint8)
    d = (0.005 + 0.01 * rng.random((rows, nb), dtype=np.float32)).astype(np.float16)
    blocks[:, :, :2] = d.view(np.uint8).reshape(rows, nb, 2)
    blocks[:, :, 2:] = rng.integers(0, 256, size=(rows, nb, 16), dtype=np.uint8)
    return blocks.reshape(rows, nb * 18)


def q8_0_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 blocks ``[rows, cols / 32 * 34]``: fp16 d ~ 0.001, random int8."""
    nb = cols // 32
    blocks = np.empty((rows, nb, 34), dtype=np.uint8)
    d = (0.0005 + 0.001 * rng.random((rows, nb), dtype=np.float32)).astype(np.float16)
    blocks[:, :, :2] = d.view(np.uint8).reshape(rows, nb, 2)
    blocks[:, :, 2:] = rng.integers(0, 256, size=(rows, nb, 32), dtype=np.uint8)
    return blocks.reshape(rows, nb * 34)


def q4_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K superblocks ``[rows, cols / 256 * 144]``: d, dmin ~ 0.0002, random 6-bit
    scales and mins, random nibbles."""
    ns = cols // 256
    blocks = rng.integers(0, 256, size=(rows, ns, 144), dtype=np.uint8)
    for at in (0, 2):
        d = (0.0001 + 0.0002 * rng.random((rows, ns), dtype=np.float32)).astype(np.float16)
        blocks[:, :, at:at + 2] = d.view(np.uint8).reshape(rows, ns, 2)
    return blocks.reshape(rows, ns * 144)


def q6_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q6_K superblocks ``[rows, cols / 256 * 210]``: random codes, int8 sub-block
    scales in -64..63, d ~ 0.0001."""
    ns = cols // 256
    blocks = rng.integers(0, 256, size=(rows, ns, 210), dtype=np.uint8)
    blocks[:, :, 192:208] = rng.integers(-64, 64, size=(rows, ns, 16), dtype=np.int8).view(np.uint8)
    d = (0.00005 + 0.0001 * rng.random((rows, ns), dtype=np.float32)).astype(np.float16)
    blocks[:, :, 208:] = d.view(np.uint8).reshape(rows, ns, 2)
    return blocks.reshape(rows, ns * 210)


BLOCK_WRITERS = {"Q4_0": q4_0_blocks, "Q8_0": q8_0_blocks, "Q4_K": q4_k_blocks, "Q6_K": q6_k_blocks}
TYPES = ("Q4_0", "Q4_K_M", "Q8_0")


def tensor_type(name: str, file_type: str, layers: int) -> str:
    """The block type of a linear in a file of ``file_type`` (llama-quantize's Q4_K_M rule:
    Q6_K for the head, and for attn_v / ffn_down where it "uses more bits")."""
    if file_type != "Q4_K_M":
        return file_type
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        i = int(name.split(".")[1])
        more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        return "Q6_K" if more_bits else "Q4_K"
    return "Q4_K"


def model_tensors(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Every tensor of a file of ``shape``, numpy order (outermost first): norms and the
    router are F32, the rest block-quantized; experts stacked ``[experts, rows, cols]``."""
    head_dim = shape.hidden // shape.heads
    tensors: dict[str, tuple[int, ...]] = {"token_embd.weight": (shape.vocab, shape.hidden),
                                           "output_norm.weight": (shape.hidden,)}
    for i in range(shape.layers):
        p = f"blk.{i}."
        tensors.update({p + "attn_norm.weight": (shape.hidden,), p + "ffn_norm.weight": (shape.hidden,),
                        p + "attn_q.weight": (shape.heads * head_dim, shape.hidden),
                        p + "attn_k.weight": (shape.kv_heads * head_dim, shape.hidden),
                        p + "attn_v.weight": (shape.kv_heads * head_dim, shape.hidden),
                        p + "attn_output.weight": (shape.hidden, shape.hidden)})
        if shape.experts:
            e = shape.experts
            tensors.update({p + "ffn_gate_inp.weight": (e, shape.hidden),
                            p + "ffn_gate_exps.weight": (e, shape.ffn, shape.hidden),
                            p + "ffn_up_exps.weight": (e, shape.ffn, shape.hidden),
                            p + "ffn_down_exps.weight": (e, shape.hidden, shape.ffn)})
        else:
            tensors.update({p + "ffn_gate.weight": (shape.ffn, shape.hidden), p + "ffn_up.weight": (shape.ffn, shape.hidden),
                            p + "ffn_down.weight": (shape.hidden, shape.ffn)})
    tensors["output.weight"] = (shape.vocab, shape.hidden)
    return tensors


def _is_f32(name: str) -> bool:
    return name.endswith(("norm.weight", "ffn_gate_inp.weight"))


def write_model(path: Path, shape_name: str, file_type: str = "Q4_0") -> Path:
    """Write the random file tensor by tensor (the header first, from the shapes), so no
    more than one tensor is ever in memory: an 8B file is written in a few hundred MB."""
    import gguf

    from runtime.model.default_model import default_gguf_file
    from runtime.model.gguf_file import GGUFFile

    shape = SHAPES[shape_name]
    source = GGUFFile(default_gguf_file())
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, shape.layers), (w.add_context_length, 8192),
                       (w.add_embedding_length, shape.hidden), (w.add_feed_forward_length, shape.ffn),
                       (w.add_head_count, shape.heads), (w.add_head_count_kv, shape.kv_heads),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 500000.0),
                       (w.add_vocab_size, shape.vocab)):
        add(value)  # type: ignore[operator]
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
    meta = source.metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"].tolist()
    tokens += [f"<|reserved_{i}|>" for i in range(shape.vocab - len(tokens))]  # the 8B shape's larger vocabulary
    types += [1] * (shape.vocab - len(types))  # normal tokens: no special-token matching to build
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(meta["tokenizer.chat_template"])
    source.close()
    tensors = model_tensors(shape)
    for name, dims in tensors.items():
        if _is_f32(name):
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
            continue
        kind = gguf.GGMLQuantizationType[tensor_type(name, file_type, shape.layers)]
        block, size = gguf.GGML_QUANT_SIZES[kind]
        byte_dims = (*dims[:-1], dims[-1] // block * size)
        w.add_tensor_info(name, byte_dims, np.dtype(np.uint8), int(np.prod(byte_dims)), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims in tensors.items():
        if name.endswith("ffn_gate_inp.weight"):
            w.write_tensor_data(rng.normal(0.0, 0.02, size=dims).astype(np.float32))
        elif _is_f32(name):
            w.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            kind_name = tensor_type(name, file_type, shape.layers)
            rows = int(np.prod(dims[:-1]))
            w.write_tensor_data(BLOCK_WRITERS[kind_name](rows, dims[-1], rng).reshape(*dims[:-1], -1))
    w.close()
    return path


# ---- Arbor's side: one child process per run, through the public API ----

_ARBOR_CHILD = """
import json, resource, sys, time
import numpy as np
cfg = json.loads(sys.argv[1])
t0 = time.perf_counter()
from runtime import Engine, SamplingParams
t1 = time.perf_counter()
after_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
engine = Engine(model=cfg["model"], weights="gguf", speculation=False, num_threads=cfg["threads"],
                max_running_requests=cfg["max_running"], max_model_len=cfg["max_model_len"])
t2 = time.perf_counter()
def hwm_mib():  # this process's peak RSS so far
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out = {"import_s": t1 - t0, "load_s": t2 - t1, "rss_after_import_mib": after_import, "rss_after_load_mib": hwm_mib()}
engine.generate(input_ids=[list(range(1000, 1008))], sampling_params=SamplingParams(max_new_tokens=1))
out["first_token_at"] = time.time()
rng = np.random.default_rng(0)
def prompts(n, length):
    return [[1, *map(int, rng.integers(1000, 40000, size=length - 1))] for _ in range(n)]
def timed(batch, new):
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    done = engine.generate(input_ids=batch, sampling_params=params)
    assert all(len(d.token_ids) == new for d in done)
    return time.perf_counter() - start
if cfg["speed"]:
    timed(prompts(max(cfg["streams"]), cfg["prompt"]), 4)  # warm-up: the biggest batch's shapes
    for n in cfg["streams"]:
        one = timed(prompts(n, cfg["prompt"]), 1)
        full = timed(prompts(n, cfg["prompt"]), 1 + cfg["gen"])
        out[f"decode_{n}"] = n * cfg["gen"] / (full - one)
        out[f"rss_after_decode_{n}_mib"] = hwm_mib()
    for length in cfg["prefill"]:
        out[f"prefill_{length}"] = length / timed(prompts(1, length), 1)
        out[f"rss_after_prefill_{length}_mib"] = hwm_mib()
m = engine.metrics()  # NOTE: pages ever written, the KV pool's resident part on the CPU
page_bytes = sum(b[:engine.kv.page_size].nbytes for b in engine.kv.k + engine.kv.v)
out["kv_resident_mib"] = m["kv_pages_touched"] * page_bytes / 2**20
out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
engine.close()
"""


@dataclass(frozen=True)
class Workload:
    threads: int
    streams: tuple[int, ...]  # decode: sequences decoding together
    prompt: int  # tokens of each decoding sequence's prompt
    gen: int  # decode steps timed
    prefill: tuple[int, ...]  # prompt lengths whose prefill is timed (one stream)


def arbor_run(model: Path, work: Workload, speed: bool) -> dict[str, float]:
    cfg = {"model": str(model), "threads": work.threads, "speed": speed, "streams": list(work.streams),
           "prompt": work.prompt, "gen": work.gen, "prefill": list(work.prefill),
           "max_running": max(work.streams),
           "max_model_len": max([*work.prefill, work.prompt + work.gen + 1]) + 16}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = run_process([sys.executable, "-c", _ARBOR_CHILD, json.dumps(cfg)], cwd=REPO, env=env)
    out: dict[str, float] = json.loads(run.stdout.strip().splitlines()[-1])
    out["first_token_s"] = out.pop("first_token_at") - run.started_at
    out["peak_rss_mib"] = run.peak_rss_mib
    return out


# ---- llama.cpp's side ----

def llama_first_token(tools: LlamaTools, model: Path, work: Workload) -> dict[str, float]:
    run = run_process(first_token_command(tools, model, work.threads))
    return {"first_token_s": run.wall_s, "peak_rss_mib": run.peak_rss_mib}


def llama_speed(tools: LlamaTools, model: Path, work: Workload) -> dict[str, float]:
    out: dict[str, float] = {}
    rss = []
    single = run_process(bench_command(tools, model, work.threads, work.prefill, work.gen))
    rss.append(single.peak_rss_mib)
    tests = parse_llama_bench(single.stdout)
    out["decode_1"] = tests[f"tg{work.gen}"]
    for length in work.prefill:
        out[f"prefill_{length}"] = tests[f"pp{length}"]
    many = [n for n in work.streams if n > 1]
    if many:
        batched = run_process(batched_command(tools, model, work.threads, work.prompt, work.gen, many))
        rss.append(batched.peak_rss_mib)
        for n, row in parse_batched_bench(batched.stdout).items():
            out[f"decode_{n}"] = row["decode_tok_s"]
    out["peak_rss_mib"] = max(rss)
    return out


def one_round(side: str, model: Path, work: Workload, tools: LlamaTools | None) -> dict[str, float]:
    """A cold start, a warm start and the speed runs of one side; the figures of the round."""
    evict_from_page_cache(model)
    if side == "arbor":
        cold = arbor_run(model, work, speed=False)
        warm = arbor_run(model, work, speed=True)
        speed = dict(warm)
    else:
        assert tools is not None
        cold = llama_first_token(tools, model, work)
        warm = llama_first_token(tools, model, work)
        speed = llama_speed(tools, model, work)
    out = {k: v for k, v in speed.items() if k not in ("first_token_s", "peak_rss_mib", "load_s", "import_s")}
    out.update(cold_first_token_s=cold["first_token_s"], warm_first_token_s=warm["first_token_s"],
               peak_rss_mib=max(cold["peak_rss_mib"], warm["peak_rss_mib"], speed["peak_rss_mib"]))
    if side == "arbor":
        out.update(cold_load_s=cold["load_s"], warm_load_s=warm["load_s"], import_s=warm["import_s"])
    return out


# ---- the table ----

# metric, what it is, higher is better, the target for Arbor / llama.cpp (None: none)
METRICS: tuple[tuple[str, str, bool, float | None], ...] = (
    ("cold_first_token_s", "cold start to first token, s", False, None),
    ("warm_first_token_s", "warm start to first token, s", False, None),
    ("cold_load_s", "Arbor: Engine() on a cold file, s (target <= 3 s)", False, None),
    ("warm_load_s", "Arbor: Engine() on a warm file, s (target <= 2 s)", False, None),
    ("peak_rss_mib", "peak RSS, MiB", False, 1.25),
    # Arbor's peak, phase by phase (the high-water mark after each), and its KV pool's
    # resident part (pages ever written: fp32 KV, the prefix cache's retained pages too)
    ("rss_after_import_mib", "Arbor: peak RSS after import, MiB", False, None),
    ("rss_after_load_mib", "Arbor: peak RSS after Engine(), MiB", False, None),
    ("kv_resident_mib", "Arbor: KV pool resident at the end, MiB", False, None),
)


def metric_rows(runs: dict[str, list[dict[str, float]]], work: Workload) -> list[dict[str, Any]]:
    """One row per figure: each side's median over the rounds (and its range), the ratio
    Arbor / llama.cpp and whether the issue's target on that ratio is met."""
    metrics = list(METRICS)
    keys = {k for rounds in runs.values() for r in rounds for k in r}  # NOTE: rounds added with other sizes
    streams = sorted({*work.streams, *(int(k.split("_")[1]) for k in keys if k.startswith("decode_"))})
    prefill = sorted({*work.prefill, *(int(k.split("_")[1]) for k in keys if k.startswith("prefill_"))})
    for n in streams:
        metrics.append((f"decode_{n}", f"decode, {n} stream{'s' if n > 1 else ''}, tok/s", True,
                        1.0 if n == 1 else 1.5))
    for length in prefill:
        metrics.append((f"prefill_{length}", f"prefill {length} tokens, tok/s", True, 1.2))
    rows = []
    for key, label, higher, target in metrics:
        row: dict[str, Any] = {"figure": label}
        values = {side: [r[key] for r in rounds if key in r] for side, rounds in runs.items()}
        for side, vals in values.items():
            row[side] = median(vals) if vals else None
            row[f"{side} range"] = f"{min(vals):.4g}-{max(vals):.4g}" if len(vals) > 1 else None
        arbor, llama = row.get("arbor"), row.get("llama.cpp")
        if arbor is not None and llama is not None and llama > 0:
            ratio = arbor / llama
            row["arbor / llama.cpp"] = ratio
            if target is not None:
                met = ratio >= target if higher else ratio <= target
                row["target"] = f"{'>=' if higher else '<='} {target}x: {'met' if met else 'NOT met'}"
        rows.append(row)
    return [{k: v for k, v in row.items() if v is not None} for row in rows]


def print_rows(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        cells = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if k != "figure"]
        print(f"  {row['figure']:<48} " + ", ".join(cells))


def workload_for(shape: str, args: argparse.Namespace) -> Workload:
    big = shape == "8b"
    return Workload(threads=args.threads, streams=tuple(args.streams or ((1, 8) if big else (1, 8, 32))),
                    prompt=args.prompt or (64 if big else 128), gen=args.gen or (32 if big else 64),
                    prefill=tuple(args.prefill or ((512,) if big else (512, 4096))))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--type", choices=TYPES, default="Q4_0", help="the file's block types")
    parser.add_argument("--file", type=Path, default=None, help="the GGUF file (default: DIR/random-SHAPE-TYPE.gguf, "
                        "written when missing)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/arbor-bench-scale"))
    parser.add_argument("--llama-env", type=Path, default=None, help="the env file build_llama_cpp.sh wrote "
                        "(without it, Arbor only)")
    parser.add_argument("--rounds", "--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=None, help="default 1 8 32 (8b: 1 8)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens of each decoding stream "
                        "(default 128; 8b: 64)")
    parser.add_argument("--gen", type=int, default=None, help="decode steps timed (default 64; 8b: 32)")
    parser.add_argument("--prefill", type=int, nargs="+", default=None, help="default 512 4096 (8b: 512)")
    parser.add_argument("--title", default=None, help="results title")
    parser.add_argument("--write-only", action="store_true", help="write the file and stop")
    parser.add_argument("--name", default=None, help="results name (default bench_scale_SHAPE_TYPE)")
    parser.add_argument("--add-rounds", action="store_true", help="continue the saved campaign of that name "
                        "(its rounds kept, sides still alternating), so a long one can be run in parts")
    args = parser.parse_args(argv)
    print(reproduce_line(), flush=True)
    path = args.file or args.dir / f"random-{args.shape}-{args.type}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        write_model(path.with_suffix(".part"), args.shape, args.type).rename(path)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.1f} s", flush=True)
    if args.write_only:
        return
    work = workload_for(args.shape, args)
    tools = LlamaTools.from_env(args.llama_env) if args.llama_env else None
    sides = ["llama.cpp", "arbor"] if tools else ["arbor"]
    name = args.name or f"bench_scale_{args.shape}_{args.type}"
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    loads: list[str] = []
    done = 0
    if args.add_rounds and (RESULTS / f"{name}.json").exists():
        saved = json.loads((RESULTS / f"{name}.json").read_text())
        runs, loads, done = saved["runs"], saved["load_averages"], saved["rounds"]
        print(f"continuing {name}: {done} rounds saved", flush=True)
    for r in range(done, done + args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            result = one_round(side, path, work, tools)
            runs[side].append(result)
            print(f"round {r} {side}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()), flush=True)
        loads.append(load_average())
    rounds = done + args.rounds
    rows = metric_rows(runs, work)
    print_rows(rows)
    size_mib = path.stat().st_size / 2**20
    peer = f"llama.cpp {tools.commit} (llama-bench, llama-batched-bench)" if tools else "no peer"
    summary = [f"Random-weight {args.shape} file, {args.type} ({size_mib:.0f} MiB), written by bench_scale; "
               f"Arbor (Engine, weights=gguf, speculation off) against {peer} on the same file, "
               f"{work.threads} threads each, {rounds} rounds, sides alternated; medians.",
               f"Decode: {work.gen} steps after {work.prompt}-token prompts (decode-only tok/s; llama.cpp's one "
               f"stream: llama-bench tg{work.gen} from an empty context). Prefill: one stream, one new token.",
               "Ratios are Arbor / llama.cpp; the targets are issue 26's. Load average after each round: "
               + "; ".join(loads) + "."]
    result = save_result(name, {"title": args.title or f"Arbor vs llama.cpp on one GGUF: {args.shape} shape, "
                                f"{args.type}", "summary": summary, "rows": rows, "file_mib": size_mib,
                                "workload": vars(work), "rounds": rounds, "load_averages": loads, "runs": runs})
    print("saved", result)


if __name__ == "__main__":
    main()
