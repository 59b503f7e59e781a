"""Reads that feed later prompts: blocking ``s["x"]`` vs lazy ``s.ref("x")``.

One program, two ways of writing it: ``n`` branches, each generates an idea and then
expands it, the idea quoted in the next prompt. With ``b["idea"]`` the body blocks on
branch 0's idea before it appends branch 1's first gen, so the branches run one after the
other; with ``b.ref("idea")`` (what ``trace`` records as a ``var`` edge) the body never
blocks, every branch is submitted at once and the engine batches them. Same outputs
(seeded sampling), measured in the same process on the default model, alternating the two
sides; median wall time of ``--repeats`` runs and the ratio.

    .venv/bin/python benchmarks/bench_dsl_refs.py [--branches 4] [--tokens 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend_dsl import assistant, gen, program, user  # noqa: E402


@program
def expand(s: Any, n: int, tokens: int, lazy: bool) -> None:
    s += user("Give one idea for a weekend project.")
    forks = s.fork(n)
    for i, branch in enumerate(forks):
        branch += assistant(gen("idea", max_tokens=tokens, temperature=0.8, seed=i))
        idea = branch.ref("idea") if lazy else branch["idea"]
        branch += user("Expand on this idea: " + idea)
        branch += assistant(gen("more", max_tokens=tokens, temperature=0.8, seed=100 + i))
    forks.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from runtime import Engine

    print("reproduce: .venv/bin/python benchmarks/bench_dsl_refs.py " + " ".join(sys.argv[1:]))
    engine = Engine(model="default")
    graph = expand.trace(engine, n=args.branches, tokens=args.tokens, lazy=False)
    print(f"trace with s['idea']: {len(graph.nodes)} nodes, complete={graph.complete}")
    expand.run(engine, n=1, tokens=2, lazy=True)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, Any] = {}
    for _ in range(args.repeats):
        for lazy in (False, True):
            start = time.perf_counter()
            state = expand.run(engine, n=args.branches, tokens=args.tokens, lazy=lazy)
            times[lazy].append(time.perf_counter() - start)
            outputs[lazy] = state["more"]
    eager, lazy_s = statistics.median(times[False]), statistics.median(times[True])
    print(f"blocking reads: {eager:.2f} s   lazy refs: {lazy_s:.2f} s   ratio {eager / lazy_s:.2f}x "
          f"(median of {args.repeats}; runs {times})")
    print(f"same outputs: {outputs[False] == outputs[True]}")
    print(f"load average: {os.getloadavg()}")
    engine.close()


if __name__ == "__main__":
    main()
