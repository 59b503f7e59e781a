"""Simulate the data-parallel router at N = 2..64 workers: cache hit rate, load imbalance
and throughput of cache-aware routing vs round robin vs consistent hashing on the prefix.

What is real and what is modelled:

- The routing decisions are the real ones: ``runtime.router.policy`` (the code the HTTP
  router runs), keyed by token ids, with the router's own capacity-bound prefix indexes.
- Each worker's cache is a real ``RadixTree`` over a ``PagePool`` of ``--capacity`` tokens
  (page size 1; ``runtime.router.prefix_index.PrefixIndex``), LRU-evicted as the engine
  evicts: a request's hit is the tree's match of its prompt, then its prompt and output
  are inserted (``cache_finished``).
- A worker's time is modelled: a request costs
  ``overhead + prefill_s_per_token * uncached prompt tokens + decode_s_per_token * output
  tokens``, served in arrival order (a work-conserving server: throughput is total work
  over time, which is what continuous batching conserves; per-token decode cost is the
  marginal cost measured at a batch, not at batch 1). The constants come from
  ``benchmarks/sim_router_calibrate.py`` run on this engine (its JSON in
  benchmarks/results/), or from ``--prefill-s-per-token`` etc.
- Load: closed loop, ``--concurrency`` requests in flight per worker (clients that send
  the next request of the trace when one finishes); the router sees each worker's
  requests in flight, as the HTTP router does.

The trace (seeded): ``--tenants`` tenants with Zipf(``--zipf``) popularity, each with a
system prompt of 200-1500 tokens; 55% multi-turn chats (a new chat, or the next turn of
one of the tenant's open chats: system + every earlier turn and answer + a new message),
30% few-shot batch jobs (a tenant's 800-2000-token template + a 100-400-token document;
a third of the tenants run such jobs), 15% one-off prompts with no shared prefix.

    .venv/bin/python benchmarks/sim_router.py [--workers 2 8 32 64] [--requests-per-worker 250]

Writes benchmarks/results/sim_router.md and .json (generated; results/ is not committed).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, load_average, reproduce_line  # noqa: E402

from runtime.router.config import PolicyConfig  # noqa: E402
from runtime.router.policy import make_policy  # noqa: E402
from runtime.router.prefix_index import PrefixIndex  # noqa: E402

POLICIES = ("cache_aware", "round_robin", "consistent_hash")
VOCAB = 49152


@dataclass(frozen=True)
class Costs:
    """Seconds of worker time (the service-time model)."""

    prefill_s_per_token: float
    decode_s_per_token: float
    request_overhead_s: float


@dataclass(frozen=True)
class TraceRequest:
    prompt: list[int]
    output: list[int]


# ---- the trace ---------------------------------------------------------------------------
def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@dataclass
class _Tenant:
    system: list[int]
    few_shot: list[int] | None
    chats: list[list[int]] = field(default_factory=list)  # open chats' histories (prompt so far)


def make_trace(num_requests: int, num_tenants: int, zipf: float, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    tenants = [_Tenant(_tokens(rng, rng.randint(200, 1500)),
                       _tokens(rng, rng.randint(800, 2000)) if rng.random() < 1 / 3 else None)
               for _ in range(num_tenants)]
    weights = [1.0 / (rank + 1) ** zipf for rank in range(num_tenants)]
    trace = []
    for _ in range(num_requests):
        tenant = rng.choices(tenants, weights)[0]
        kind = rng.random()
        if kind < 0.15:
            trace.append(TraceRequest(_tokens(rng, rng.randint(100, 800)), _tokens(rng, rng.randint(20, 200))))
        elif kind < 0.45 and tenant.few_shot is not None:
            trace.append(TraceRequest(tenant.few_shot + _tokens(rng, rng.randint(100, 400)),
                                      _tokens(rng, rng.randint(10, 50))))
        else:
            trace.append(_chat_turn(rng, tenant))
    return trace


def _chat_turn(rng: random.Random, tenant: _Tenant) -> TraceRequest:
    if tenant.chats and rng.random() < 0.65:
        i = rng.randrange(len(tenant.chats))
        history = tenant.chats[i]
    else:
        history, i = list(tenant.system), len(tenant.chats)
        tenant.chats.append(history)
    prompt = history + _tokens(rng, rng.randint(20, 120))
    output = _tokens(rng, rng.randint(50, 300))
    if len(prompt) + len(output) > 6000:  # a chat this long is closed
        tenant.chats.pop(i)
    else:
        tenant.chats[i] = prompt + output
    if len(tenant.chats) > 8:
        tenant.chats.pop(0)
    return TraceRequest(prompt, output)


# ---- simulated workers -------------------------------------------------------------------
class SimWorker:
    """A worker's prefix cache (a real RadixTree of fixed capacity, through the same
    ``PrefixIndex`` wrapper the router uses) and its clock."""

    def __init__(self, capacity: int) -> None:
        self.cache = PrefixIndex(capacity)
        self.free_at = 0.0  # when the work queued so far is done
        self.busy_s = 0.0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def serve(self, req: TraceRequest, now: float, costs: Costs) -> float:
        """Queue ``req`` at ``now``; returns its completion time. NOTE: the cache is updated
        at once: the worker serves in arrival order, so every later request of this worker
        starts after this one finished and cached its tokens."""
        hit = self.cache.match_len(req.prompt)
        self.prompt_tokens += len(req.prompt)
        self.cached_tokens += hit
        work = (costs.request_overhead_s + costs.prefill_s_per_token * (len(req.prompt) - hit)
                + costs.decode_s_per_token * len(req.output))
        self.busy_s += work
        self.free_at = max(now, self.free_at) + work
        self.cache.insert(req.prompt + req.output)  # the engine's cache_finished, LRU eviction
        return self.free_at


@dataclass(frozen=True)
class SimResult:
    policy: str
    num_workers: int
    hit_rate: float  # cached / prompt tokens, from the workers' trees
    imbalance: float  # max / mean busy seconds over workers
    throughput_rps: float  # requests / simulated seconds
    output_tok_s: float
    wall_s: float  # seconds this simulation took to run


def simulate(policy_name: str, num_workers: int, trace: list[TraceRequest], costs: Costs,
             capacity: int, concurrency: int) -> SimResult:
    started = time.perf_counter()
    policy = make_policy(PolicyConfig(policy=policy_name, index_capacity=capacity,  # type: ignore[arg-type]
                                      hash_prefix_len=64), num_workers)
    workers = [SimWorker(capacity) for _ in range(num_workers)]
    loads = [0] * num_workers
    candidates = list(range(num_workers))
    done: list[tuple[float, int]] = []  # (completion time, worker)
    now, end = 0.0, 0.0
    for i, req in enumerate(trace):
        if i >= concurrency * num_workers:  # closed loop: wait for a request to finish
            now, w = heapq.heappop(done)
            loads[w] -= 1
        route = policy.route(req.prompt, loads, candidates)
        finish = workers[route.worker].serve(req, now, costs)
        loads[route.worker] += 1
        heapq.heappush(done, (finish, route.worker))
        end = max(end, finish)
    busy = [w.busy_s for w in workers]
    hit = sum(w.cached_tokens for w in workers) / sum(w.prompt_tokens for w in workers)
    return SimResult(policy_name, num_workers, hit, max(busy) / (sum(busy) / len(busy)), len(trace) / end,
                     sum(len(r.output) for r in trace) / end, time.perf_counter() - started)


# ---- report ------------------------------------------------------------------------------
def load_costs(args: argparse.Namespace) -> tuple[Costs, str]:
    path = RESULTS / "sim_router_calibration.json"
    if args.prefill_s_per_token is not None:
        return Costs(args.prefill_s_per_token, args.decode_s_per_token, args.request_overhead_s), "flags"
    if not path.is_file():
        raise SystemExit(f"no calibration: run benchmarks/sim_router_calibrate.py first (writes {path}), "
                         "or give --prefill-s-per-token, --decode-s-per-token and --request-overhead-s")
    c = json.loads(path.read_text())
    return Costs(c["prefill_s_per_token"], c["decode_s_per_token"], c["request_overhead_s"]), str(path)


def table(results: list[SimResult]) -> str:
    rr = {r.num_workers: r for r in results if r.policy == "round_robin"}
    lines = ["| N | policy | hit rate | imbalance (max/mean) | throughput (req/s) | vs round robin |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in results:
        ratio = r.throughput_rps / rr[r.num_workers].throughput_rps
        lines.append(f"| {r.num_workers} | {r.policy} | {r.hit_rate:.1%} | {r.imbalance:.2f} | "
                     f"{r.throughput_rps:.2f} | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8, 32, 64])
    parser.add_argument("--requests-per-worker", type=int, default=250)
    parser.add_argument("--min-requests", type=int, default=2000)
    parser.add_argument("--tenants", type=int, default=400)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--capacity", type=int, default=40_000, help="KV tokens cached per worker")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-s-per-token", type=float, default=None)
    parser.add_argument("--decode-s-per-token", type=float, default=None)
    parser.add_argument("--request-overhead-s", type=float, default=0.0)
    args = parser.parse_args()
    costs, source = load_costs(args)
    print(reproduce_line())
    print(f"costs ({source}): {costs}")
    results = []
    for n in args.workers:
        trace = make_trace(max(args.min_requests, args.requests_per_worker * n), args.tenants, args.zipf, args.seed)
        for name in POLICIES:
            r = simulate(name, n, trace, costs, args.capacity, args.concurrency)
            results.append(r)
            print(f"N={n:3d} {name:16s} hit {r.hit_rate:6.1%}  imbalance {r.imbalance:5.2f}  "
                  f"{r.throughput_rps:8.2f} req/s  ({len(trace)} requests, {r.wall_s:.1f} s to simulate)",
                  flush=True)
    md = table(results)
    print(md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    header = (f"# Router simulation\n\n{reproduce_line()}\n\ncosts ({source}): {costs}\n\n"
              f"trace: {args.tenants} tenants, Zipf {args.zipf}, {args.requests_per_worker} requests per "
              f"worker (at least {args.min_requests}); worker cache {args.capacity} tokens; "
              f"{args.concurrency} requests in flight per worker; load average {load_average()}\n\n")
    (RESULTS / "sim_router.md").write_text(header + md + "\n")
    (RESULTS / "sim_router.json").write_text(json.dumps(
        {"costs": costs.__dict__, "costs_source": source, "args": vars(args),
         "results": [r.__dict__ for r in results], "command": reproduce_line()}, indent=2))


if __name__ == "__main__":
    main()
