"""How long an Engine takes to load a GGUF file, in wall and CPU seconds, and its peak RSS,
this checkout against another source tree (e.g. main before a change), sides alternated.

    git archive 50241dd | tar -x -C /tmp/arbor-before
    python benchmarks/bench_load.py FILE.gguf --before /tmp/arbor-before --rounds 3 --cold

Each run is a fresh process of one side (``PYTHONPATH`` = its tree): the imports, then
``Engine(model=FILE, max_running_requests=8, max_model_len=2048)`` timed (wall;
CPU = user + system of every thread), then 16 greedy tokens of one stream (a check that it
runs, not a speed claim) and the process's peak RSS. ``--cold`` drops the file's pages from
the page cache before each run (``posix_fadvise(DONTNEED)``, this file only), as for a
file never read before; otherwise the first run warms the cache and every run is warm.
The C kernels must be built already for both sides (run once without timing first).
The issue's memory budget beside it: file size + the KV pool the engine planned + 400 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MiB = 2**20
BUDGET_EXTRA_MIB = 400  # the allowance over file size + KV pool

_CHILD = """
import json, resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
w0, c0 = time.perf_counter(), cpu()
from runtime import Engine, SamplingParams
w1, c1 = time.perf_counter(), cpu()
engine = Engine(model=sys.argv[1], max_running_requests=8, max_model_len=2048)
w2, c2 = time.perf_counter(), cpu()
load_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
kv = sum(t.numel() * t.element_size() for t in engine.kv.k + engine.kv.v)
params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
done = engine.generate(input_ids=[[1, *range(100, 116)]], sampling_params=params)
print(json.dumps({"import_s": w1 - w0, "import_cpu_s": c1 - c0, "load_s": w2 - w1, "load_cpu_s": c2 - c1,
                  "load_peak_rss_mib": load_rss, "kv_pool_mib": kv / 2**20,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "tokens": len(done[0].token_ids)}))
engine.close()
"""


def drop_from_page_cache(path: Path) -> None:
    """Evict ``path``'s clean pages from the page cache (this file only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_once(tree: Path, path: Path, cold: bool) -> dict[str, Any]:
    if cold:
        drop_from_page_cache(path)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, cwd=tree,
                         env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: the load failed ({out.returncode}): {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def summarize(runs: list[dict[str, Any]], file_mib: float) -> dict[str, Any]:
    """Medians of the runs' figures, each run's load wall and CPU seconds, and the budget."""
    keys = ("import_s", "import_cpu_s", "load_s", "load_cpu_s", "load_peak_rss_mib", "peak_rss_mib", "kv_pool_mib")
    row: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}
    row["load_s_runs"] = [round(r["load_s"], 2) for r in runs]
    row["load_cpu_s_runs"] = [round(r["load_cpu_s"], 2) for r in runs]
    row["budget_mib"] = round(file_mib + row["kv_pool_mib"] + BUDGET_EXTRA_MIB)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--before", type=Path, help="the other source tree (omit: this checkout only)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the file from the page cache before each run")
    parser.add_argument("--save", help="save the table as benchmarks/results/<SAVE>.json")
    args = parser.parse_args()
    print("command:", " ".join(sys.argv))
    sides = {"after": REPO} if args.before is None else {"before": args.before.resolve(), "after": REPO}
    rows = []
    for path in args.files:
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        errors: dict[str, str] = {}
        for i in range(args.rounds):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))  # alternated
            for side in order:
                try:
                    r = run_once(sides[side], path, args.cold)
                except RuntimeError as exc:  # NOTE: a side that cannot load the file is a result too
                    print(f"{path.name} {side}: {exc}", flush=True)
                    errors[side] = str(exc)[-500:]
                    continue
                runs[side].append(r)
                print(f"{path.name} {side}: load {r['load_s']:.2f} s wall, {r['load_cpu_s']:.2f} s CPU "
                      f"(+{r['import_s']:.2f} s imports), peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
        file_mib = path.stat().st_size / MiB
        for side, side_runs in runs.items():
            figures = summarize(side_runs, file_mib) if side_runs else {"error": errors.get(side, "no run")}
            rows.append({"file": path.name, "file_mib": round(file_mib), "side": side, "cold": args.cold,
                         **figures, "loadavg": os.getloadavg()[0]})
            print(json.dumps(rows[-1]))
    if args.save:
        from benchmarks.common import save_result

        kind = "first load (file not in the page cache)" if args.cold else "warm load (file in the page cache)"
        save_result(args.save, {"title": f"GGUF load time and peak RSS, {kind}",
                                "summary": [f"Engine(model=FILE, max_running_requests=8, max_model_len=2048) "
                                            f"after imports; medians of {args.rounds} runs a side, sides "
                                            "alternated; CPU = user + system of all threads; budget = file + "
                                            f"KV pool + {BUDGET_EXTRA_MIB} MiB."], "rows": rows})


if __name__ == "__main__":
    main()
