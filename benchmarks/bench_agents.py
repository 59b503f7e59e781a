"""Agent programs under KV pressure: graph-aware retention + a disk tier vs plain LRU, in one run.

``--agents`` concurrent ``@program`` agents, each a loop of ``--turns`` turns: the model
writes a tool call (``--call-tokens`` tokens), the tool runs (a sleep of 0.5-3 s, drawn per
turn), its result (``--result-words`` words) joins the conversation, and the next turn
continues it; contexts grow to a few thousand tokens. Meanwhile ``--background`` threads
send single-shot requests of ``--background-words`` words of their own, back to back. The
KV pool (``--num-pages``) holds the agents' contexts or the background traffic, not both.

Each round builds a fresh engine of the same model and settings, so every side starts
cold; rounds are interleaved (on, off, off, on, ...) and use the same seeds on every side
(the same texts, tool latencies and background prompts). The sides (``--sides``):

- **retention_tier**: the DSL backend sends each run's id with its requests, the engine
  pins each run's latest state until the run ends (``runtime/cache/retention.py``), and
  evicted pages go to a disk tier in a fresh temporary directory (``--kv-tier-dir``,
  ``runtime/cache/kv_tier.py``) instead of being dropped;
- **retention** / **tier**: one feature alone (to tell their shares apart);
- **lru**: the same backend with ``retain_runs=False`` and no tier: plain LRU eviction
  (the baseline).

Reported per side: prompt tokens recomputed on the agents' later turns (turns after the
first: what a cache that kept the conversation would not compute), their cache hit rate,
their TTFT p50/p99 (from the DSL's send to the first token, queueing included), total
throughput (finished requests, agents' and background's, per second of the round; and
prompt + output tokens per second), and the engine's prefill tokens. A later turn's
cached tokens are split into pool hits and tier reloads. The integrity checks (pool,
radix tree, pins, tier) run after every round.

    .venv/bin/python benchmarks/bench_agents.py [--agents 4] [--turns 5] [--rounds 1]

A campaign longer than one sitting is run in parts (``--name part1``, ``--name part2``,
``--first-round 1`` for the second part so its order continues the interleaving) and
merged: ``bench_agents.py --merge part1 part2 --name bench_agents``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, load_average, median, reproduce_line, save_result  # noqa: E402

from frontend_dsl import assistant, gen, program, system, user  # noqa: E402
from frontend_dsl.backend import GenChunk, GenParams  # noqa: E402
from frontend_dsl.engine_backend import EngineBackend  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402

# side -> (retention: the backend pins each run's state, tier: evicted pages go to disk)
SIDES = {"retention_tier": (True, True), "retention": (True, False), "tier": (False, True), "lru": (False, False)}
BASELINE = "lru"
WORDS = ["amber", "river", "stone", "north", "quiet", "market", "ledger", "cobalt", "signal", "harbor", "velvet", "orbit", "lantern", "meadow", "copper", "thistle", "granite", "falcon", "ember", "willow", "prism", "canyon", "tundra", "saffron", "beacon", "glacier", "cedar", "marble", "ripple", "summit"]
ENGINE_COUNTERS = ("prefill_tokens", "retention_pins_refused", "kv_tier_stored_pages", "kv_tier_dropped_pages",
                   "num_retractions")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class TimedBackend(EngineBackend):
    """The engine backend, recording each generation: its run, prompt and cached tokens
    (pool and tier), and its TTFT (send to first token). Records are appended on the DSL
    loop thread."""

    def __init__(self, engine: Engine, retain_runs: bool) -> None:
        super().__init__(engine, retain_runs=retain_runs)
        self.records: list[dict[str, Any]] = []

    async def generate(self, input_ids: list[int], params: GenParams) -> AsyncIterator[GenChunk]:
        start, first, final = time.perf_counter(), None, None
        async for chunk in super().generate(input_ids, params):
            if first is None and chunk.delta_token_ids:
                first = time.perf_counter()
            final = chunk
            yield chunk
        assert final is not None
        self.records.append({"run": params.run_id, "prompt": len(input_ids), "cached": final.num_cached_tokens,
                             "tier": final.num_tier_cached_tokens, "output": len(final.token_ids),
                             "ttft": (first or time.perf_counter()) - start})


@program
def agent(s: Any, name: str, seed: int, turns: int, system_words: int, result_words: int,
          call_tokens: int, sleep_s: tuple[float, float]) -> None:
    rng = random.Random(seed)
    s += system(f"You are {name}, an agent with tools. " + words(rng, system_words))
    s += user("Task: " + words(rng, 30))
    for t in range(turns):
        s += assistant(gen(f"call{t}", max_tokens=call_tokens, temperature=0, ignore_eos=True))
        _ = s[f"call{t}"]  # the call is written: the tool runs now
        time.sleep(rng.uniform(*sleep_s))
        s += user("Tool result: " + words(rng, result_words))


def background(engine: Engine, seed: int, n_words: int, stop: threading.Event, out: list[int]) -> None:
    """Back-to-back single-shot requests with prompts of their own; tokens processed go to ``out``."""
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    while not stop.is_set():
        result = engine.generate(f"Summarize: {words(rng, n_words)}", params)[0]
        out.append(len(result.prompt_token_ids) + len(result.token_ids))


def make_engine(args: argparse.Namespace, tier_dir: str | None) -> Engine:
    extra = {k: _value(v) for k, v in (a.split("=", 1) for a in args.engine_args)}
    tier: dict[str, Any] = {"kv_tier_dir": tier_dir, "kv_tier_max_bytes": args.tier_max_bytes} if tier_dir else {}
    # NOTE: the pool is the bound on what the cache keeps (not the CPU's default cap on it,
    # docs/memory.md), so "the pool cannot hold everything" is the one pressure, on every side.
    settings = {"prefix_cache_max_pages": args.num_pages, **tier, **extra}
    return Engine(args.model, page_size=16, num_pages=args.num_pages, max_model_len=8192,
                  retention_max_pages=args.retention_max_pages, **settings)


def one_round(side: str, round_idx: int, args: argparse.Namespace) -> dict[str, Any]:
    """One side's round on an engine of its own (cold pool, empty tier)."""
    retain, tiered = SIDES[side]
    tier_dir = tempfile.mkdtemp(prefix="arbor-bench-agents-") if tiered else None
    engine = make_engine(args, tier_dir)
    try:
        result = run_workload(engine, side, retain, round_idx, args)
    finally:
        engine.close()
        if tier_dir:
            shutil.rmtree(tier_dir, ignore_errors=True)
    return result


def run_workload(engine: Engine, side: str, retain: bool, round_idx: int, args: argparse.Namespace) -> dict[str, Any]:
    backend = TimedBackend(engine, retain_runs=retain)
    before = engine.metrics()
    stop, done_bg = threading.Event(), [list[int]() for _ in range(args.background)]
    threads = [threading.Thread(target=background, args=(engine, 1000 * round_idx + i, args.background_words,
                                                         stop, done_bg[i]), daemon=True)
               for i in range(args.background)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    batch = [{"name": f"agent-{i}", "seed": 100 * round_idx + i, "turns": args.turns,
              "system_words": args.system_words, "result_words": args.result_words,
              "call_tokens": args.call_tokens, "sleep_s": tuple(args.tool_sleep)} for i in range(args.agents)]
    agent.run_batch(batch, backend=backend, max_concurrency=args.agents)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started  # NOTE: up to the last background request's end, which counts
    assert engine.wait_idle(60)
    engine.check_integrity()  # raises if the pool, tree, pins or tier drifted
    after = engine.metrics()
    out = summarize(side, backend.records, done_bg, wall)
    out.update({k: after[k] - before[k] for k in ENGINE_COUNTERS}, integrity="passed")
    return out


def summarize(side: str, records: list[dict[str, Any]], background_tokens: list[list[int]],
              wall: float) -> dict[str, Any]:
    seen: dict[str, int] = {}
    later = []
    for r in records:  # a run's generations are sequential: their order is their turn
        turn = seen[r["run"]] = seen.get(r["run"], -1) + 1
        if turn > 0:
            later.append(r)
    prompt = sum(r["prompt"] for r in later)
    cached = sum(r["cached"] for r in later)
    tier = sum(r["tier"] for r in later)
    ttfts = sorted(r["ttft"] for r in later)
    bg = [n for thread in background_tokens for n in thread]
    agent_tokens = sum(r["prompt"] + r["output"] for r in records)
    return {"side": side, "wall_s": wall, "later_turns": len(later),
            "later_prompt_tokens": prompt, "recomputed_tokens": prompt - cached,
            "pool_hit_tokens": cached - tier, "tier_hit_tokens": tier,
            "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_s": median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "requests_per_s": (len(records) + len(bg)) / wall,
            "tokens_per_s": (agent_tokens + sum(bg)) / wall,
            "background_requests": len(bg)}


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One side over its rounds: token counts summed, rates and latencies as medians."""
    out: dict[str, Any] = {"side": rounds[0]["side"], "rounds": len(rounds)}
    for key in ("later_turns", "later_prompt_tokens", "recomputed_tokens", "pool_hit_tokens", "tier_hit_tokens",
                "background_requests", *ENGINE_COUNTERS):
        out[key] = sum(r[key] for r in rounds)
    for key in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "requests_per_s", "tokens_per_s", "wall_s"):
        out[key] = median([r[key] for r in rounds])
    return out


def report(results: dict[str, list[dict[str, Any]]], settings: dict[str, Any]) -> dict[str, Any]:
    """Every side against the LRU baseline: ratios, targets met or not, and the summary."""
    rows = {side: combine(rounds) for side, rounds in results.items()}
    off = rows[BASELINE]
    low, high = settings["tool_sleep"]
    summary = [f"{settings['agents']} agents x {settings['turns']} turns (tool calls sleep {low:g}-{high:g} s, "
               f"{settings['result_words']}-word results on a {settings['system_words']}-word system prompt) + "
               f"{settings['background']} background streams of {settings['background_words']} words, KV pool "
               f"{settings['num_pages']} pages of 16, {len(results[BASELINE])} rounds a side interleaved, "
               f"a fresh engine per round; shared 2-core machine, load {load_average()}"]
    ratios, met = {}, {}
    for side, on in rows.items():
        if side == BASELINE:
            continue
        r = ratios[side] = {"recomputed": off["recomputed_tokens"] / max(1, on["recomputed_tokens"]),
                            "ttft_p50": off["ttft_p50_s"] / on["ttft_p50_s"],
                            "throughput": on["requests_per_s"] / off["requests_per_s"]}
        m = met[side] = {"recomputed >= 2x fewer": r["recomputed"] >= 2.0, "ttft_p50 >= 1.5x lower": r["ttft_p50"] >= 1.5,
                         "throughput not lower": r["throughput"] >= 1.0}
        word = {True: "met", False: "not met"}
        summary += [f"{side} vs {BASELINE}: recomputed prompt tokens on later turns {r['recomputed']:.2f}x fewer "
                    f"({on['recomputed_tokens']} vs {off['recomputed_tokens']}; of the later turns' "
                    f"{on['later_prompt_tokens']} prompt tokens {on['pool_hit_tokens']} pool hits, "
                    f"{on['tier_hit_tokens']} tier reloads; target 2x: {word[m['recomputed >= 2x fewer']]}); "
                    f"TTFT p50 of later turns {r['ttft_p50']:.2f}x lower ({on['ttft_p50_s']:.2f} vs "
                    f"{off['ttft_p50_s']:.2f} s, p99 {on['ttft_p99_s']:.2f} vs {off['ttft_p99_s']:.2f} s; target "
                    f"1.5x: {word[m['ttft_p50 >= 1.5x lower']]}); throughput {r['throughput']:.2f}x "
                    f"({on['requests_per_s']:.3f} vs {off['requests_per_s']:.3f} req/s, {on['tokens_per_s']:.0f} vs "
                    f"{off['tokens_per_s']:.0f} tok/s; target not lower: {word[m['throughput not lower']]})"]
    summary.append("integrity checks (pool, radix tree, pins, tier) passed after every round")
    return {"title": "Agent programs under KV pressure: retention + tier vs LRU", "summary": summary,
            "rows": list(rows.values()), "ratios": ratios, "targets_met": met, "rounds": results,
            "settings": settings}


def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    sides = args.sides.split(",")
    if BASELINE not in sides or any(s not in SIDES for s in sides):
        raise SystemExit(f"--sides must name {BASELINE} and any of {', '.join(SIDES)}; got {args.sides}")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for i in range(args.first_round, args.first_round + args.rounds):
        for side in sides if i % 2 == 0 else sides[::-1]:  # on, off, off, on, ...
            r = one_round(side, i, args)
            results[side].append(r)
            print(f"round {i}: {side:15s} recomputed {r['recomputed_tokens']:6d}  pool {r['pool_hit_tokens']:6d}  "
                  f"tier {r['tier_hit_tokens']:6d}  hit {r['hit_rate']:.2f}  ttft p50 {r['ttft_p50_s']:.2f} s  "
                  f"p99 {r['ttft_p99_s']:.2f} s  {r['requests_per_s']:.3f} req/s  wall {r['wall_s']:.1f} s  "
                  f"load {load_average()}", flush=True)
    return results


def merge(names: list[str]) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any], list[str]]:
    """The rounds of saved parts (same settings but the rounds), side by side."""
    results: dict[str, list[dict[str, Any]]] = {}
    settings: dict[str, Any] = {}
    commands = []
    for name in names:
        path = Path(name) if name.endswith(".json") else RESULTS / f"{name}.json"
        part = json.loads(path.read_text())
        commands.append(part["command"])
        for side, rounds in part["rounds"].items():
            results.setdefault(side, []).extend(rounds)
        settings = {k: v for k, v in part["settings"].items() if k not in ("rounds", "first_round", "merge")}
    return results, settings, commands


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--sides", default="retention_tier,lru", help=f"comma-separated, of: {', '.join(SIDES)}")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="rounds per side (interleaved on/off/off/on)")
    p.add_argument("--first-round", type=int, default=0, help="index of the first round (seeds and order)")
    p.add_argument("--system-words", type=int, default=600)
    p.add_argument("--result-words", type=int, default=350)
    p.add_argument("--call-tokens", type=int, default=16)
    p.add_argument("--tool-sleep", type=float, nargs=2, default=[0.5, 3.0], metavar=("MIN", "MAX"),
                   help="seconds a tool call takes, drawn uniformly per turn")
    p.add_argument("--background", type=int, default=1, help="background request threads")
    p.add_argument("--background-words", type=int, default=400)
    p.add_argument("--num-pages", type=int, default=480, help="KV pool (page size 16)")
    p.add_argument("--retention-max-pages", type=int, default=200, help="pin budget per run")
    p.add_argument("--tier-max-bytes", type=int, default=2**30, help="the tier's file size")
    p.add_argument("--engine-args", nargs="*", default=[], help="more engine settings, key=value")
    p.add_argument("--merge", nargs="+", default=None, metavar="NAME", help="merge saved parts (result names, or .json paths) instead of running")
    p.add_argument("--name", default="bench_agents")
    args = p.parse_args(argv)
    print(reproduce_line())
    if args.merge:
        results, settings, commands = merge(args.merge)
    else:
        results, commands = run(args), []
        settings = {k: v for k, v in vars(args).items() if k not in ("name", "merge")}
    payload = report(results, settings)
    if commands:
        payload["parts"] = commands
    for line in payload["summary"]:
        print(line)
    save_result(args.name, payload)
    return payload


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


if __name__ == "__main__":
    main()
