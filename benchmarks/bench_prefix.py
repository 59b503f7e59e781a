"""Prefix sharing and latency under mixed load, on the default model (fp32, CPU or GPU).

Part 1 (shared prefix): N requests share one P-token prefix, each with its own S-token
suffix and O greedy output tokens (EOS ignored). Wall time of one ``generate`` call with
the prefix cache on, with it off (``disable_prefix_cache=True``), and of HF transformers
``generate`` on the same weights as one left-padded batch. Prints the cache hit rate and
both speed-ups (targets: >= 5x vs cache off, >= 5x vs HF).

Part 2 (mixed load): R requests decode; once all of them stream tokens, a L-token prompt
arrives and is prefilled in chunks of ``--chunk`` tokens (``chunked_prefill_size``; by
default the engine's own choice, 16 on the CPU). The
running requests' inter-token latency p99 (per-token timestamps from
``engine.generate_stream``) is compared with a run without the long prompt (target: within
3x).

    .venv/bin/python benchmarks/bench_prefix.py [--quick] [--skip-hf] [--chunk 32]
        [--llama-env llama.cpp-build/llama.cpp.env]

``--llama-env`` adds llama.cpp's own batched engine to part 1, on the default model's GGUF
file: ``llama-batched-bench -pps`` (N sequences on one shared prompt of P + S tokens,
prefilled once, then O decode steps of all of them; its prefill + decode time, the
threads torch uses here). Its shared prompt includes the suffixes, so llama.cpp prefills
S x (N - 1) fewer tokens than the requests hold: slightly in its favour.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, reproduce_line, save_result, timed  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402
from runtime.model.loader import load_tokenizer, resolve_model_dir  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    num_requests: int  # part 1: requests sharing the prefix
    prefix_len: int
    suffix_len: int
    output_len: int
    num_running: int  # part 2: decoding requests
    running_prompt_len: int
    running_output_len: int
    long_prompt_len: int


FULL = Sizes(16, 512, 16, 32, 16, 16, 64, 2000)
QUICK = Sizes(8, 128, 8, 8, 4, 8, 24, 400)


def token_ids(tokenizer: Any, n: int, seed: int) -> list[int]:
    """``n`` ordinary text token ids (a fixed passage, rotated by ``seed``)."""
    text = ("The history of the old harbour town goes back many centuries, to the fishermen "
            "who first settled the bay and traded salt, grain and timber along the coast. ")
    ids: list[int] = tokenizer(text * (n // 20 + 2), add_special_tokens=False)["input_ids"]
    return (ids[seed % 17 :] + ids)[:n]


def shared_prefix_prompts(tokenizer: Any, s: Sizes) -> list[list[int]]:
    prefix = token_ids(tokenizer, s.prefix_len, 0)
    return [prefix + [1000 + 37 * i + j for j in range(s.suffix_len)] for i in range(s.num_requests)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def run_engine(prompts: list[list[int]], s: Sizes, **config: Any) -> dict[str, Any]:
    with Engine(model="default", page_size=16, **config) as engine:
        engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params=greedy(2))  # warm-up
        seconds, outs = timed(engine.generate, input_ids=prompts, sampling_params=greedy(s.output_len))
        assert all(len(o.token_ids) == s.output_len for o in outs)
        engine.wait_idle()
        m = engine.metrics()
        # The warm-up's 4 prompt tokens are in the totals: count this run's tokens only.
        total = sum(len(p) for p in prompts)
        hit = m["cached_prompt_tokens"] / total
        return {"seconds": seconds, "cache_hit_rate": hit, "tokens": [o.token_ids for o in outs],
                "retractions": m["num_retractions"], "model_dir": str(resolve_model_dir("default"))}


def run_hf(model_dir: str, prompts: list[list[int]], s: Sizes) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")  # left-padded
    with torch.inference_mode():
        model.generate(**tok.pad({"input_ids": [[5, 6, 7, 8]]}, return_tensors="pt"),
                       max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
        seconds, out = timed(model.generate, **batch, do_sample=False, max_new_tokens=s.output_len,
                             min_new_tokens=s.output_len, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == batch["input_ids"].shape[1] + s.output_len
    del model
    gc.collect()
    return seconds


def run_llama_shared(env: Path, s: Sizes, threads: int) -> float:
    """Seconds of llama.cpp's batched engine on part 1's shape, the prompt shared."""
    from peer_llama import LlamaTools, batched_command, parse_batched_bench, run_process

    from runtime.model.default_model import default_gguf_file

    cmd = batched_command(LlamaTools.from_env(env), default_gguf_file(), threads, s.prefix_len + s.suffix_len,
                          s.output_len, [s.num_requests], shared_prompt=True)
    return parse_batched_bench(run_process(cmd).stdout)[s.num_requests]["total_s"]


# ---- part 2: latency under mixed load --------------------------------------------------------
async def stream(engine: Engine, ids: list[int], n: int, stamps: list[float],
                 started: asyncio.Event | None = None) -> None:
    async for out in engine.generate_stream(input_ids=ids, sampling_params=greedy(n)):
        now = time.perf_counter()
        stamps.extend([now] * len(out.delta_token_ids))
        if started is not None and len(stamps) >= 4:
            started.set()


async def mixed_load(engine: Engine, s: Sizes, with_long: bool) -> tuple[list[float], float]:
    """ITLs (s) of the running requests, and the long prompt's TTFT (s) if it ran."""
    stamps: list[list[float]] = [[] for _ in range(s.num_running)]
    started = [asyncio.Event() for _ in range(s.num_running)]
    tasks = [asyncio.create_task(stream(engine, token_ids(engine.tokenizer, s.running_prompt_len, 100 + i),
                                        s.running_output_len, stamps[i], started[i]))
             for i in range(s.num_running)]
    ttft = float("nan")
    if with_long:
        await asyncio.gather(*(e.wait() for e in started))  # all are decoding now
        arrived, first = time.perf_counter(), list[float]()
        await stream(engine, token_ids(engine.tokenizer, s.long_prompt_len, 3), 1, first)
        ttft = first[0] - arrived
    await asyncio.gather(*tasks)
    itls = [b - a for st in stamps for a, b in zip(st, st[1:], strict=False)]
    return itls, ttft


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def run_mixed(s: Sizes, chunk: int | None) -> dict[str, Any]:
    with Engine(model="default", page_size=16, chunked_prefill_size=chunk) as engine:
        chunk = engine.scheduler.chunked_prefill_size
        engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params=greedy(2))  # warm-up
        base, _ = asyncio.run(mixed_load(engine, s, with_long=False))
        engine.wait_idle()
        loaded, ttft = asyncio.run(mixed_load(engine, s, with_long=True))
    return {"itl_p99_alone_ms": 1e3 * p99(base), "itl_p99_mixed_ms": 1e3 * p99(loaded),
            "itl_p50_alone_ms": 1e3 * statistics.median(base),
            "itl_p50_mixed_ms": 1e3 * statistics.median(loaded),
            "long_prompt_ttft_s": ttft, "ratio": p99(loaded) / p99(base), "chunk": chunk}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--skip-hf", action="store_true", help="skip the HF transformers baseline")
    ap.add_argument("--chunk", type=int, default=None,
                    help="chunked_prefill_size for part 2 (default: the engine's default)")
    ap.add_argument("--llama-env", type=Path, default=None,
                    help="part 1 also on llama-batched-bench (the env file build_llama_cpp.sh wrote)")
    args = ap.parse_args()
    s = QUICK if args.quick else FULL
    print(reproduce_line())
    print(f"sizes: {s}; torch threads: {torch.get_num_threads()}; load average: {load_average()}")

    prompts = shared_prefix_prompts(load_tokenizer(resolve_model_dir("default")), s)
    on = run_engine(prompts, s)
    off = run_engine(prompts, s, disable_prefix_cache=True)
    same = on["tokens"] == off["tokens"]
    hf = float("nan") if args.skip_hf else run_hf(on["model_dir"], prompts, s)
    part1 = {"cache_on_s": on["seconds"], "cache_off_s": off["seconds"], "hf_s": hf,
             "cache_hit_rate": on["cache_hit_rate"], "speedup_vs_off": off["seconds"] / on["seconds"],
             "speedup_vs_hf": hf / on["seconds"], "same_tokens_on_off": same}
    print(f"shared prefix: {s.num_requests} requests x ({s.prefix_len} shared + {s.suffix_len} own) "
          f"tokens, {s.output_len} out")
    print(f"  cache on   {on['seconds']:8.2f} s   hit rate {on['cache_hit_rate']:.3f}")
    print(f"  cache off  {off['seconds']:8.2f} s   -> {part1['speedup_vs_off']:.2f}x (target >= 5x)")
    if args.skip_hf:
        print("  HF generate    skipped (--skip-hf)")
    else:
        print(f"  HF generate {hf:7.2f} s   -> {part1['speedup_vs_hf']:.2f}x (target >= 5x)")
    print(f"  same tokens with cache on and off: {same}")
    if args.llama_env is not None:
        llama = run_llama_shared(args.llama_env, s, torch.get_num_threads())
        part1.update(llama_batched_s=llama, speedup_vs_llama=llama / on["seconds"])
        print(f"  llama-batched-bench -pps {llama:5.2f} s   -> {part1['speedup_vs_llama']:.2f}x")

    part2 = run_mixed(s, args.chunk)
    print(f"mixed load: {s.num_running} decoding ({s.running_output_len} tokens each) + one "
          f"{s.long_prompt_len}-token prompt, chunk {part2['chunk']}")
    print(f"  ITL p99 without the long prompt {part2['itl_p99_alone_ms']:8.1f} ms "
          f"(p50 {part2['itl_p50_alone_ms']:.1f})")
    print(f"  ITL p99 with it                 {part2['itl_p99_mixed_ms']:8.1f} ms "
          f"(p50 {part2['itl_p50_mixed_ms']:.1f})  -> {part2['ratio']:.2f}x (target <= 3x)")
    print(f"  long prompt TTFT {part2['long_prompt_ttft_s']:.2f} s")
    print(f"load average: {load_average()}")
    path = save_result("bench_prefix_quick" if args.quick else "bench_prefix",
                       {"args": vars(args), "sizes": vars(s), "shared_prefix": part1, "mixed_load": part2})
    print("saved", path)


if __name__ == "__main__":
    main()
