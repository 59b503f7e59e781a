"""llama.cpp's own benchmark tools as a peer: their command lines, the parsing of their
output, and a child process's wall time and peak RSS.

The binaries come from the documented build (``benchmarks/peers/build_llama_cpp.sh``,
which writes ``llama.cpp.env``): ``llama-bench`` times one stream (prefill of N tokens,
decode of N tokens from an empty context), ``llama-batched-bench`` decodes N parallel
sequences, each after its own prompt, in one batch per step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def read_env(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of the file build_llama_cpp.sh writes."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if "=" in line and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


@dataclass(frozen=True)
class LlamaTools:
    bench: Path
    batched_bench: Path
    commit: str

    @classmethod
    def from_env(cls, path: Path) -> LlamaTools:
        env = read_env(path)
        missing = [k for k in ("LLAMA_BENCH", "LLAMA_BATCHED_BENCH") if k not in env]
        if missing:
            raise ValueError(f"{path} names no {', '.join(missing)}: not a build_llama_cpp.sh env file")
        return cls(Path(env["LLAMA_BENCH"]), Path(env["LLAMA_BATCHED_BENCH"]), env.get("LLAMA_COMMIT", "unknown"))


def bench_command(tools: LlamaTools, model: Path, threads: int, prompts: Sequence[int], gen: int,
                  repeats: int = 1) -> list[str]:
    """``llama-bench``: one test per prompt length (prefill only) and one of ``gen`` decoded
    tokens, each ``repeats`` times after its own warm-up, as JSON."""
    return [str(tools.bench), "-m", str(model), "-t", str(threads), "-p", ",".join(map(str, prompts or [0])),
            "-n", str(gen), "-r", str(repeats), "-o", "json"]


def batched_command(tools: LlamaTools, model: Path, threads: int, prompt: int, gen: int,
                    streams: Sequence[int], shared_prompt: bool = False) -> list[str]:
    """``llama-batched-bench``: for each count in ``streams``, that many sequences of a
    ``prompt``-token prompt each (``shared_prompt``: one prompt, prefilled once and shared
    by all), then ``gen`` decode steps of all of them."""
    # NOTE: a margin per sequence: llama.cpp pads its KV cells, and a context of exactly the
    # tokens refuses the last ones
    ctx = max(256, max(streams) * (prompt + gen + 16))
    return [str(tools.batched_bench), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
            "-npp", str(prompt), "-ntg", str(gen), "-npl", ",".join(map(str, streams)), "--output-format", "jsonl",
            *(["-pps"] if shared_prompt else [])]


def first_token_command(tools: LlamaTools, model: Path, threads: int) -> list[str]:
    """The smallest run that loads the model and decodes one token (its wall time is the
    start-to-first-token time, load included)."""
    return batched_command(tools, model, threads, prompt=8, gen=1, streams=[1])


def parse_llama_bench(text: str) -> dict[str, float]:
    """``llama-bench -o json`` -> tokens/s per test: ``pp512`` (prefill of 512 tokens),
    ``tg64`` (64 decoded tokens), ``pp512+tg64`` (both in one test)."""
    start = text.find("[")
    if start < 0:
        raise ValueError(f"no JSON list in llama-bench's output: {text[:200]!r}")
    tests: list[dict[str, Any]] = json.loads(text[start:])
    out = {}
    for test in tests:
        p, g = int(test["n_prompt"]), int(test["n_gen"])
        name = f"pp{p}" if g == 0 else f"tg{g}" if p == 0 else f"pp{p}+tg{g}"
        out[name] = float(test["avg_ts"])
    return out


def parse_batched_bench(text: str) -> dict[int, dict[str, float]]:
    """``llama-batched-bench --output-format jsonl`` -> per sequence count: prefill tokens/s
    (all prompts), decode tokens/s (all sequences' tokens over the decode steps' time)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if "pl" in row:
            out[int(row["pl"])] = {"prefill_tok_s": float(row["speed_pp"]), "decode_tok_s": float(row["speed_tg"]),
                                   "prefill_s": float(row["t_pp"]), "decode_s": float(row["t_tg"]),
                                   "total_s": float(row["t"])}
    if not out:
        raise ValueError(f"no result lines in llama-batched-bench's output: {text[:200]!r}")
    return out


@dataclass(frozen=True)
class ProcessRun:
    stdout: str
    wall_s: float
    peak_rss_mib: float
    started_at: float  # time.time() just before the process started


# NOTE: a child forked from a big process inherits its parent's high-water RSS (the kernel
# keeps the larger of the old and new address space's at exec), so the measured command is
# started by this small launcher, and its own peak is read by the launcher's wait4.
_LAUNCHER = """
import json, os, subprocess, sys, time
started_at, start = time.time(), time.perf_counter()
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
wall = time.perf_counter() - start
with open(sys.argv[1], "w") as f:
    json.dump({"status": os.waitstatus_to_exitcode(status), "wall_s": wall, "started_at": started_at,
               "peak_rss_kib": usage.ru_maxrss}, f)
"""


def run_process(cmd: Sequence[str], cwd: Path | None = None, env: dict[str, str] | None = None,
                timeout_s: float = 1800.0) -> ProcessRun:
    """Run ``cmd`` to its end: its stdout, wall time and peak RSS (the kernel's count for
    that one process, from ``wait4``, so both engines are measured the same way)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "run.json"
        with open(Path(tmp) / "out", "w+b") as out, open(Path(tmp) / "err", "w+b") as err:
            launcher = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCHER, str(report), *cmd],
                                        stdout=out, stderr=err, cwd=cwd, env=env, start_new_session=True)
            try:
                launcher.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
                raise RuntimeError(f"{cmd[0]} ran past {timeout_s} s") from None
            out.seek(0)
            err.seek(0)
            stdout = out.read().decode(errors="replace")
            stderr = err.read().decode(errors="replace")
        if launcher.returncode != 0 or not report.exists():
            raise RuntimeError(f"the launcher of {cmd[0]} failed ({launcher.returncode}): {stderr[-2000:]}")
        run = json.loads(report.read_text())
    if run["status"] != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited with {run['status']}: {stderr[-2000:]}")
    return ProcessRun(stdout, run["wall_s"], run["peak_rss_kib"] / 1024, run["started_at"])


def evict_from_page_cache(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (where no process maps them), so the next
    load reads it from disk: a cold load without touching the rest of the machine's cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
