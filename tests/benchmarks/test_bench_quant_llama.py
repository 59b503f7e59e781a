"""``bench_quant.py --llama-env``: llama.cpp's side through its own batched engine, one
``llama-batched-bench`` run per repeat with the workload's shape (a fake tool here)."""

from __future__ import annotations

import argparse
import json
import stat
import sys
from pathlib import Path

from benchmarks.bench_quant import make_runs, run_llama_tools

FAKE = """#!{python}
import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
pl = int(args[args.index("-npl") + 1])
print("main: n_kv_max = 4096")
print(json.dumps({{"pp": 1, "tg": 1, "pl": pl, "n_kv": 1, "t_pp": 0.5, "speed_pp": 1.0, "t_tg": 1.5,
                  "speed_tg": 1.0, "t": pl / 8, "speed": 1.0}}))
"""


def test_each_workload_runs_batched_bench_in_its_shape(tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    tool = tmp_path / "llama-batched-bench"
    tool.write_text(FAKE.format(python=sys.executable, log=str(log)))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = tmp_path / "llama.cpp.env"
    env.write_text(f"LLAMA_BENCH=/nonexistent\nLLAMA_BATCHED_BENCH={tool}\nLLAMA_COMMIT=0c1e570\n")
    args = argparse.Namespace(workloads=["b1", "b32", "prefix"], prompt_len=32, new_tokens=96, repeats=2,
                              threads=2, seed=0)
    seconds = run_llama_tools(env, "/models/m.gguf", args, make_runs(args))
    # NOTE: the tool's own prefill + decode time ("t"), one run per repeat
    assert seconds == {"b1": [0.125, 0.125], "b32": [4.0, 4.0], "prefix": [2.0, 2.0]}
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 6
    shapes = {tuple(c[c.index(k) + 1] for k in ("-npp", "-ntg", "-npl")) + ("-pps" in c,) for c in calls}
    assert shapes == {("32", "96", "1", False), ("32", "48", "32", False), ("528", "32", "16", True)}
    assert all(c[c.index("-m") + 1] == "/models/m.gguf" and c[c.index("-t") + 1] == "2" for c in calls)


def test_bench_prefix_runs_the_shared_prompt_shape(tmp_path: Path) -> None:
    """bench_prefix's part 1 on llama.cpp: N sequences on one shared prompt of P + S tokens."""
    from benchmarks.bench_prefix import QUICK, run_llama_shared
    from runtime.model.default_model import default_gguf_file

    log = tmp_path / "calls.jsonl"
    tool = tmp_path / "llama-batched-bench"
    tool.write_text(FAKE.format(python=sys.executable, log=str(log)))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = tmp_path / "llama.cpp.env"
    env.write_text(f"LLAMA_BENCH=/nonexistent\nLLAMA_BATCHED_BENCH={tool}\n")
    assert run_llama_shared(env, QUICK, 2) == QUICK.num_requests / 8
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert call[call.index("-npp") + 1] == str(QUICK.prefix_len + QUICK.suffix_len)
    assert call[call.index("-npl") + 1] == str(QUICK.num_requests) and "-pps" in call
    assert call[call.index("-m") + 1] == str(default_gguf_file())
