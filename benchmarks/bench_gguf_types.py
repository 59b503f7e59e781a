"""Decode speed per GGUF block type, engine to engine: Arbor (``weights="gguf"``,
speculation off) against llama.cpp's own tools on the same file, sides interleaved.

One stream: Arbor's decode rate is the difference of two greedy runs (``--tokens`` more
tokens, prompts distinct), so the prompt's prefill is not in it; llama.cpp's is
``llama-bench -p 0 -n TOKENS`` (tg). Eight streams: Arbor decodes 8 distinct prompts at
once (the same difference); llama.cpp's is ``llama-batched-bench -npl 8`` (its S_TG).
``--arbor`` names one or more checkouts (``label=path``: e.g. a "before" copy of main and
this tree), each run in its own process with that checkout first on ``PYTHONPATH``.

    python benchmarks/bench_gguf_types.py --file Q5_0=/tmp/m.Q5_0.gguf --arbor after=. \\
        --llama-bin /path/to/llama.cpp/build/bin --rounds 3 --save bench_gguf_types
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, save_result  # noqa: E402

THREADS = 2

_CHILD = """
import json, sys, time
from runtime import Engine, SamplingParams
path, tokens = sys.argv[1], int(sys.argv[2])
engine = Engine(model=path, weights="gguf", speculation=False, max_running_requests=8, max_model_len=2048)
engine.generate(input_ids=[[1, 5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                         ignore_eos=True))
out = {}
seed = 100
for streams in (1, 8):
    times = []
    for n in (16, 16 + tokens):
        prompts = [[1, *range(seed + 40 * i, seed + 40 * i + 16)] for i in range(streams)]
        seed += 40 * streams
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        times.append(time.perf_counter() - t)
    out[f"decode_{streams}"] = streams * tokens / (times[1] - times[0])
print(json.dumps(out))
engine.close()
"""


def run_arbor(root: Path, path: Path, tokens: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": str(THREADS)}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(tokens)], capture_output=True, text=True,
                         cwd=root, env=env, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run_llama(bin_dir: Path, path: Path, tokens: int) -> dict[str, float]:
    bench = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(THREADS), "-p", "0",
                            "-n", str(tokens), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    one = float(json.loads(bench.stdout)[0]["avg_ts"])
    batched = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", str(path), "-t", str(THREADS),
                              "-c", "2048", "-npp", "16", "-ntg", str(tokens), "-npl", "8"],
                             capture_output=True, text=True, check=True)
    return {"decode_1": one, "decode_8": _batched_tg(batched.stdout + batched.stderr)}


def _batched_tg(text: str) -> float:
    """S_TG t/s of llama-batched-bench's one table row (| PP | TG | B | N_KV | T_PP s |
    S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |)."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and all(re.fullmatch(r"[0-9.]+", c) for c in cells):
            return float(cells[7])
    raise RuntimeError(f"no llama-batched-bench table in:\n{text[-2000:]}")


def _pair(text: str) -> tuple[str, Path]:
    label, _, path = text.partition("=")
    if not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, got {text!r}")
    return label, Path(path).resolve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", type=_pair, action="append", required=True, help="TYPE=path of a GGUF file")
    parser.add_argument("--arbor", type=_pair, action="append", required=True, help="LABEL=checkout")
    parser.add_argument("--llama-bin", type=Path, help="llama.cpp's build/bin (llama-bench, llama-batched-bench)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens timed per stream")
    parser.add_argument("--save", help="results/<name>.json")
    args = parser.parse_args()
    print("command:", " ".join(sys.argv), "| load average", load_average())
    sides = [*(("arbor " + label, root) for label, root in args.arbor)]
    if args.llama_bin:
        sides.append(("llama.cpp", args.llama_bin))
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rnd in range(args.rounds):
        for kind, path in args.file:
            # NOTE: the order of the sides alternates between rounds
            for side, where in sides if rnd % 2 == 0 else sides[::-1]:
                r = run_llama(where, path, args.tokens) if side == "llama.cpp" else run_arbor(where, path, args.tokens)
                runs.setdefault((kind, side), []).append(r)
                print(f"round {rnd} {kind} {side}: 1 stream {r['decode_1']:.1f} tok/s, 8 streams "
                      f"{r['decode_8']:.1f} tok/s (load average {load_average()})", flush=True)
    rows = _rows(runs, [k for k, _ in args.file], [s for s, _ in sides])
    for row in rows:
        print(row)
    if args.save:
        save_result(args.save, {
            "title": "Decode by GGUF block type: Arbor vs llama.cpp, same file",
            "summary": [f"{args.rounds} interleaved rounds, medians; {THREADS} threads each; decode only "
                        f"({args.tokens} tokens a stream); Arbor weights='gguf', speculation off"],
            "rows": rows, "runs": {f"{k} / {s}": v for (k, s), v in runs.items()}})


def _rows(runs: dict[tuple[str, str], list[dict[str, float]]], kinds: list[str], sides: list[str]) -> list[dict[str, Any]]:
    rows = []
    for kind in kinds:
        for streams in (1, 8):
            row: dict[str, Any] = {"type": kind, "streams": streams}
            for side in sides:
                row[f"{side} tok/s"] = round(median([r[f"decode_{streams}"] for r in runs[(kind, side)]]), 1)
            if "llama.cpp" in sides:
                for side in sides[:-1]:
                    row[f"{side} / llama.cpp"] = round(row[f"{side} tok/s"] / row["llama.cpp tok/s"], 2)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
