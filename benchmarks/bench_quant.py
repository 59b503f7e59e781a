"""Quantized weights: Arbor fp32 / int8 / int4 / GGUF-native against llama.cpp on the same
GGUF file (the default model's own Q4_1), in one run.

Workloads (greedy, EOS ignored, so every side produces the same token counts):

- decode, batch 1: one prompt of ``--prompt-len`` random ordinary tokens, ``--new-tokens``
  generated; tokens/s;
- decode, batch 32: 32 such prompts at once (llama.cpp through ``llama-cpp-python`` runs
  one sequence at a time: its figure is the 32 served one after another);
- prefix: 16 requests x (512 shared + 16 own tokens) -> 32 tokens each; Arbor in one
  ``generate`` with its prefix cache, llama.cpp one after another reusing the longest
  common prefix of its context (its own prefix reuse);
- memory: peak RSS of ``examples/quickstart.py`` with each weight format, and of a process
  that loads llama.cpp and answers the same three questions.

Each side runs in its own spawned process, with ``--threads`` torch / llama.cpp threads,
one side after another (one model in memory at a time), on the same prompts. llama.cpp is skipped, with a line
saying so, when ``llama_cpp`` is not importable (``pip install -e '.[bench]'``; it builds
from source, ~7 min with ``CMAKE_ARGS="-DGGML_NATIVE=ON"``).

``--llama-env FILE`` (the env file of ``benchmarks/peers/build_llama_cpp.sh``) measures
llama.cpp with its own batched engine instead: ``llama-batched-bench`` on the same file, the
same prompt lengths, token counts and sequence counts, its time from the first prompt token
to the last decoded one (prefill and decode, as Arbor's ``generate`` is timed): b1 one
sequence, b32 32 sequences decoding in one batch, prefix 16 sequences on one shared
prompt of 528 tokens prefilled once (``-pps``; the 16 own tokens of each request are not
separate there, which favours llama.cpp slightly).

    .venv/bin/python benchmarks/bench_quant.py [--formats fp32 int8 int4 gguf] [--repeats 3]
        [--threads 2] [--skip-llama] [--skip-memory] [--workloads b1 b32 prefix]

A format ``<name>-eager`` (``gguf-eager``) runs that format without the fused decode step
(``fused_decode=False``), and ``<name>`` is then also reported against it: the fused step
against its own baseline, ``--formats gguf gguf-eager int8 int8-eager --skip-memory``.

On a machine shared with other work, OpenMP barriers stall whenever another process holds
a core: read the figures next to the load average printed with each row.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ORDINARY_IDS = range(1000, 40000)  # ordinary word pieces of the default model's vocabulary
BOS = 1
Workload = list[list[int]]  # prompts (token ids)


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


# ---- the two kinds of side -----------------------------------------------------------------
class ArborSide:
    def __init__(self, fmt: str, threads: int) -> None:
        """``fmt``: a weights format, or ``<format>-eager`` for it without the fused decode
        step (the layer-by-layer path: the fused step's baseline)."""
        from runtime import Engine

        weights, eager = fmt.removesuffix("-eager"), fmt.endswith("-eager")
        self.engine = Engine(model="default", weights=weights, num_threads=threads, speculation=False,
                             page_size=16, fused_decode=not eager)

    def run(self, prompts: Workload, new_tokens: int) -> float:
        """Seconds for all ``prompts`` in one ``generate`` (the engine batches them)."""
        from runtime import SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outs = self.engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        assert all(len(o.token_ids) == new_tokens for o in outs)
        return seconds


class LlamaCppSide:
    def __init__(self, gguf: str, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)

    def run(self, prompts: Workload, new_tokens: int) -> float:
        """Seconds for ``prompts`` one after another; the context keeps the previous
        prompt, so a shared prefix is reused (``Llama.generate`` with ``reset=True``)."""
        start = time.perf_counter()
        for prompt in prompts:
            produced = 0
            for _ in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
                produced += 1
                if produced == new_tokens:
                    break
            assert produced == new_tokens
        return time.perf_counter() - start

    def clear(self) -> None:
        """Forget the context, so the next prompt shares nothing with the last one."""
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()


_side: ArborSide | LlamaCppSide | None = None


def _start(kind: str, arg: str, threads: int) -> None:
    global _side
    _side = ArborSide(arg, threads) if kind == "arbor" else LlamaCppSide(arg, threads)


def _run(prompts: Workload, new_tokens: int, fresh: bool) -> float:
    assert _side is not None
    if fresh and isinstance(_side, LlamaCppSide):
        _side.clear()
    return _side.run(prompts, new_tokens)


# ---- workloads -----------------------------------------------------------------------------
class Prompts:
    """Random prompts; no two in a run share a token after BOS unless asked to."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.firsts = self.rng.sample(ORDINARY_IDS, len(ORDINARY_IDS))

    def fresh(self, length: int) -> list[int]:
        return [BOS, self.firsts.pop(), *self.rng.choices(ORDINARY_IDS, k=length - 2)]

    def batch(self, n: int, length: int) -> Workload:
        return [self.fresh(length) for _ in range(n)]

    def shared(self, n: int, prefix_len: int, own_len: int) -> Workload:
        prefix = self.fresh(prefix_len)
        return [prefix + self.rng.choices(ORDINARY_IDS, k=own_len) for _ in range(n)]


WORKLOADS: dict[str, Callable[[Prompts, argparse.Namespace], tuple[Workload, int]]] = {
    "b1": lambda p, a: (p.batch(1, a.prompt_len), a.new_tokens),
    "b32": lambda p, a: (p.batch(32, a.prompt_len), a.new_tokens // 2),
    "prefix": lambda p, a: (p.shared(16, 512, 16), 32),
}


def make_runs(args: argparse.Namespace) -> dict[str, list[tuple[Workload, int]]]:
    """Every workload's prompts for every repeat, drawn once: each side gets the same."""
    prompts = Prompts(args.seed)
    return {w: [WORKLOADS[w](prompts, args) for _ in range(args.repeats)] for w in args.workloads}


def run_llama_tools(env: Path, gguf: str, args: argparse.Namespace,
                    runs: dict[str, list[tuple[Workload, int]]]) -> dict[str, list[float]]:
    """llama.cpp's batched engine on the workloads' shapes, one ``llama-batched-bench``
    process per run: seconds from the first prompt token to the last decoded token."""
    from peer_llama import LlamaTools, batched_command, parse_batched_bench, run_process

    tools = LlamaTools.from_env(env)
    seconds: dict[str, list[float]] = {}
    for w, reps in runs.items():
        prompts, new_tokens = reps[0]
        cmd = batched_command(tools, Path(gguf), args.threads, len(prompts[0]), new_tokens, [len(prompts)],
                              shared_prompt=w == "prefix")
        seconds[w] = [parse_batched_bench(run_process(cmd).stdout)[len(prompts)]["total_s"] for _ in reps]
    print(f"  llama.cpp (llama-batched-bench {tools.commit}): done (load {load_average()})", flush=True)
    return seconds


def run_side(name: str, kind: str, arg: str, args: argparse.Namespace,
             runs: dict[str, list[tuple[Workload, int]]]) -> dict[str, list[float]]:
    """Start one side in a fresh process, warm it up with one run of every workload on
    prompts of its own (no timed run is a side's first at its batch size), time every run;
    the process exits before the next side starts (one model in memory at a time)."""
    warm = Prompts(args.seed + 1)
    with ProcessPoolExecutor(1, get_context("spawn"), initializer=_start,
                             initargs=(kind, arg, args.threads)) as worker:
        for w in runs:
            worker.submit(_run, *WORKLOADS[w](warm, args), True).result()
        seconds = {w: [worker.submit(_run, batch, new, True).result() for batch, new in reps]
                   for w, reps in runs.items()}
    print(f"  {name}: done (load {load_average()})", flush=True)
    return seconds


def _report(workload: str, tokens: int, seconds: dict[str, list[float]]) -> dict[str, Any]:
    tok_s = {n: tokens / median(s) for n, s in seconds.items()}
    base = tok_s.get("arbor-fp32")
    peer = tok_s.get("llama.cpp")
    load = load_average()
    print(f"\n{workload}: {tokens} tokens per run, medians of {len(next(iter(seconds.values())))} "
          f"(load {load})")
    for name, value in tok_s.items():
        vs_fp32 = f"{value / base:5.2f}x fp32" if base else ""
        vs_peer = f"{value / peer:5.2f}x llama.cpp" if peer else ""
        eager = tok_s.get(f"{name}-eager")
        vs_eager = f"{value / eager:5.2f}x eager" if eager else ""
        runs = " ".join(f"{tokens / s:.1f}" for s in seconds[name])
        print(f"  {name:<17} {value:8.1f} tok/s  {vs_fp32}  {vs_peer}  {vs_eager}   (runs: {runs})", flush=True)
    return {"workload": workload, "tokens": tokens, "tok_s": tok_s, "seconds": seconds, "load_average": load}


# ---- memory --------------------------------------------------------------------------------
QUICKSTART = """
import sys
sys.path.insert(0, {examples!r})
from runtime import Engine
import quickstart
quickstart.main(Engine(model="default", weights={weights!r}, num_threads={threads}))
"""

LLAMA_QA = """
from llama_cpp import Llama
llm = Llama(model_path={gguf!r}, n_ctx=2048, n_threads={threads}, verbose=False)
for q in ["What is the capital of France?", "What is 2 + 2?", "Name a primary colour."]:
    out = llm.create_chat_completion([{{"role": "user", "content": q}}], max_tokens=32, temperature=0)
    print(out["choices"][0]["message"]["content"])
"""


def peak_rss_mb(code: str) -> float:
    """Peak resident memory of a fresh Python process running ``code`` (MiB)."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err, env={**os.environ, "PYTHONPATH": str(ROOT)})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"memory probe failed ({proc.returncode}): {err.read()[-2000:]}")
    return usage.ru_maxrss / 1024  # KiB on Linux


def run_memory(args: argparse.Namespace, gguf: str, with_llama: bool) -> dict[str, float]:
    print(f"\nmemory: peak RSS of examples/quickstart.py (load {load_average()})")
    rows = {}
    for weights in [f for f in args.formats if not f.endswith("-eager")]:
        code = QUICKSTART.format(examples=str(ROOT / "examples"), weights=weights, threads=args.threads)
        rows[f"arbor-{weights}"] = peak_rss_mb(code)
    if with_llama:
        rows["llama.cpp"] = peak_rss_mb(LLAMA_QA.format(gguf=gguf, threads=args.threads))
    for name, mb in rows.items():
        print(f"  {name:<12} {mb:8.0f} MiB")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["fp32", "int8", "int4", "gguf"])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96, help="per request at batch 1 (half at batch 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--llama-env", type=Path, default=None, help="llama.cpp through its own llama-batched-bench "
                    "(the env file benchmarks/peers/build_llama_cpp.sh wrote) instead of llama-cpp-python")
    args = ap.parse_args()
    print(reproduce_line())
    from runtime.model.default_model import default_gguf_file

    gguf = str(default_gguf_file())
    with_llama = not args.skip_llama and args.llama_env is None and llama_cpp_available()
    if not with_llama and args.llama_env is None:
        print("llama.cpp: skipped (" + ("--skip-llama" if args.skip_llama else
              "llama_cpp not importable: pip install -e '.[bench]'") + ")")
    runs = make_runs(args)
    sides = [(f"arbor-{w}", "arbor", w) for w in args.formats]
    if with_llama:
        sides.append(("llama.cpp", "llama", gguf))
    print("running each side in turn:")
    seconds = {name: run_side(name, kind, arg, args, runs) for name, kind, arg in sides}
    if args.llama_env is not None and not args.skip_llama:
        seconds["llama.cpp"] = run_llama_tools(args.llama_env, gguf, args, runs)
    rows = [_report(w, len(reps[0][0]) * reps[0][1], {n: seconds[n][w] for n in seconds})
            for w, reps in runs.items()]
    memory = {} if args.skip_memory else run_memory(args, gguf, with_llama)
    self_usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nload average: {load_average()} (this process: {self_usage:.0f} MiB)")
    print("saved", save_result("bench_quant", {"args": vars(args), "rows": rows, "peak_rss_mib": memory}))


if __name__ == "__main__":
    main()
