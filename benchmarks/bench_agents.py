"""Agent programs under KV pressure: graph-aware retention vs plain LRU, one engine, one run.

``--agents`` concurrent ``@program`` agents, each a loop of ``--turns`` turns: the model
writes a tool call (``--call-tokens`` tokens), the tool runs (a sleep of 0.5-3 s, drawn per
turn), its result (``--result-words`` words) joins the conversation, and the next turn
continues it; contexts grow to a few thousand tokens. Meanwhile ``--background`` threads
send single-shot requests of ``--background-words`` words of their own, back to back. The
KV pool (``--num-pages``) holds the agents' contexts or the background traffic, not both.

Two sides on the same engine, rounds interleaved (on, off, off, on, ...), the cache
flushed before each round and the same seeds on both sides (the same texts, tool
latencies and background prompts):

- **retention**: the DSL backend sends each run's id with its requests; the engine pins
  each run's latest state until the run ends (``runtime/cache/retention.py``);
- **lru**: the same backend with ``retain_runs=False``: plain LRU eviction (the baseline).

Reported per side: prompt tokens recomputed on the agents' later turns (turns after the
first: what a cache that kept the conversation would not compute), their cache hit rate,
their TTFT p50/p99 (from the DSL's send to the first token, queueing included), total
throughput (finished requests, agents' and background's, per second of the round; and
prompt + output tokens per second), and the engine's prefill tokens. The integrity checks
run after every round.

    .venv/bin/python benchmarks/bench_agents.py [--agents 4] [--turns 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, median, reproduce_line, save_result  # noqa: E402

from frontend_dsl import assistant, gen, program, system, user  # noqa: E402
from frontend_dsl.backend import GenChunk, GenParams  # noqa: E402
from frontend_dsl.engine_backend import EngineBackend  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402

SIDES = ("retention", "lru")
WORDS = ["amber", "river", "stone", "north", "quiet", "market", "ledger", "cobalt", "signal", "harbor", "velvet", "orbit", "lantern", "meadow", "copper", "thistle", "granite", "falcon", "ember", "willow", "prism", "canyon", "tundra", "saffron", "beacon", "glacier", "cedar", "marble", "ripple", "summit"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class TimedBackend(EngineBackend):
    """The engine backend, recording each generation: its run, prompt and cached tokens,
    and its TTFT (send to first token). Records are appended on the DSL loop thread."""

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
                             "output": len(final.token_ids), "ttft": (first or time.perf_counter()) - start})


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


def one_round(engine: Engine, side: str, round_idx: int, args: argparse.Namespace) -> dict[str, Any]:
    engine.flush_cache()
    assert engine.wait_idle(60)
    backend = TimedBackend(engine, retain_runs=side == "retention")
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
    agents_done = time.perf_counter()
    stop.set()
    for t in threads:
        t.join()
    wall = agents_done - started  # NOTE: the background requests finished after it count too
    assert engine.wait_idle(60)
    engine.check_integrity()
    after = engine.metrics()
    return summarize(side, backend.records, done_bg, wall, before, after)


def summarize(side: str, records: list[dict[str, Any]], background_tokens: list[list[int]], wall: float,
              before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    seen: dict[str, int] = {}
    later = []
    for r in records:  # a run's generations are sequential: their order is their turn
        turn = seen[r["run"]] = seen.get(r["run"], -1) + 1
        if turn > 0:
            later.append(r)
    prompt = sum(r["prompt"] for r in later)
    cached = sum(r["cached"] for r in later)
    ttfts = sorted(r["ttft"] for r in later)
    bg = [n for thread in background_tokens for n in thread]
    agent_tokens = sum(r["prompt"] + r["output"] for r in records)
    return {"side": side, "wall_s": wall, "later_turns": len(later),
            "later_prompt_tokens": prompt, "recomputed_tokens": prompt - cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_s": median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "requests_per_s": (len(records) + len(bg)) / wall,
            "tokens_per_s": (agent_tokens + sum(bg)) / wall,
            "background_requests": len(bg),
            "engine_prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "pins_refused": after["retention_pins_refused"] - before["retention_pins_refused"]}


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One side over its rounds: token counts summed, rates and latencies as medians."""
    out: dict[str, Any] = {"side": rounds[0]["side"], "rounds": len(rounds)}
    for key in ("later_turns", "later_prompt_tokens", "recomputed_tokens", "background_requests",
                "engine_prefill_tokens", "pins_refused"):
        out[key] = sum(r[key] for r in rounds)
    for key in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "requests_per_s", "tokens_per_s", "wall_s"):
        out[key] = median([r[key] for r in rounds])
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="rounds per side (interleaved on/off/off/on)")
    p.add_argument("--system-words", type=int, default=400)
    p.add_argument("--result-words", type=int, default=220)
    p.add_argument("--call-tokens", type=int, default=16)
    p.add_argument("--tool-sleep", type=float, nargs=2, default=[0.5, 3.0], metavar=("MIN", "MAX"),
                   help="seconds a tool call takes, drawn uniformly per turn")
    p.add_argument("--background", type=int, default=2, help="background request threads")
    p.add_argument("--background-words", type=int, default=500)
    p.add_argument("--num-pages", type=int, default=400, help="KV pool (page size 16)")
    p.add_argument("--retention-max-pages", type=int, default=200, help="pin budget per run")
    p.add_argument("--engine-args", nargs="*", default=[], help="more engine settings, key=value")
    p.add_argument("--name", default="bench_agents")
    args = p.parse_args(argv)
    extra = dict(a.split("=", 1) for a in args.engine_args)
    engine = Engine(args.model, page_size=16, num_pages=args.num_pages, max_model_len=8192,
                    retention_max_pages=args.retention_max_pages, **{k: _value(v) for k, v in extra.items()})
    print(reproduce_line())
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    order = [SIDES[(i + i // 2) % 2] for i in range(2 * args.rounds)]  # on, off, off, on, ...
    try:
        for i, side in enumerate(order):
            r = one_round(engine, side, i // 2, args)
            results[side].append(r)
            print(f"round {i}: {side:9s} recomputed {r['recomputed_tokens']:6d}  hit {r['hit_rate']:.2f}  "
                  f"ttft p50 {r['ttft_p50_s']:.2f} s  p99 {r['ttft_p99_s']:.2f} s  "
                  f"{r['requests_per_s']:.2f} req/s  wall {r['wall_s']:.1f} s", flush=True)
    finally:
        engine.close()
    on, off = combine(results["retention"]), combine(results["lru"])
    ratios = {"recomputed": off["recomputed_tokens"] / max(1, on["recomputed_tokens"]),
              "ttft_p50": off["ttft_p50_s"] / on["ttft_p50_s"],
              "throughput": on["requests_per_s"] / off["requests_per_s"]}
    met = {"recomputed >= 2x fewer": ratios["recomputed"] >= 2.0, "ttft_p50 >= 1.5x lower": ratios["ttft_p50"] >= 1.5,
           "throughput not lower": ratios["throughput"] >= 1.0}
    low, high = args.tool_sleep
    summary = [f"{args.agents} agents x {args.turns} turns (tool calls sleep {low:g}-{high:g} s) + {args.background} "
               f"background streams, KV pool {args.num_pages} pages of 16, {args.rounds} rounds a side "
               f"interleaved; shared 2-core machine, load {load_average()}",
               f"recomputed prompt tokens on later turns: {ratios['recomputed']:.2f}x fewer with retention "
               f"({on['recomputed_tokens']} vs {off['recomputed_tokens']}; target 2x: "
               f"{'met' if met['recomputed >= 2x fewer'] else 'not met'})",
               f"TTFT p50 of later turns: {ratios['ttft_p50']:.2f}x lower ({on['ttft_p50_s']:.2f} vs "
               f"{off['ttft_p50_s']:.2f} s; target 1.5x: {'met' if met['ttft_p50 >= 1.5x lower'] else 'not met'})",
               f"throughput: {ratios['throughput']:.2f}x ({on['requests_per_s']:.2f} vs {off['requests_per_s']:.2f} "
               f"req/s; target not lower: {'met' if met['throughput not lower'] else 'not met'})"]
    for line in summary:
        print(line)
    payload = {"title": "Agent programs under KV pressure: retention vs LRU", "summary": summary,
               "rows": [on, off], "ratios": ratios, "targets_met": met, "rounds": results,
               "settings": {k: v for k, v in vars(args).items() if k != "name"}}
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
