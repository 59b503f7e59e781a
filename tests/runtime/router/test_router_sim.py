"""The router simulator (benchmarks/sim_router.py) on a small trace: the real policies
against simulated workers show the effects the full table reports."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from sim_router import Costs, make_trace, simulate  # noqa: E402

COSTS = Costs(prefill_s_per_token=0.005, decode_s_per_token=0.009, request_overhead_s=0.06)


def test_trace_is_seeded_and_shares_prefixes() -> None:
    a, b = make_trace(300, 50, 1.1, seed=1), make_trace(300, 50, 1.1, seed=1)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    firsts = [tuple(r.prompt[:32]) for r in a]
    assert len(set(firsts)) < len(firsts) * 0.7  # many requests share a system prompt or template


def test_cache_aware_beats_round_robin_and_balances_better_than_hashing() -> None:
    trace = make_trace(600, 60, 1.1, seed=0)
    results = {p: simulate(p, 6, trace, COSTS, capacity=12_000, concurrency=8)
               for p in ("cache_aware", "round_robin", "consistent_hash")}
    ca, rr, ch = results["cache_aware"], results["round_robin"], results["consistent_hash"]
    assert ca.hit_rate > rr.hit_rate + 0.1 and ca.throughput_rps > rr.throughput_rps
    assert ca.imbalance < 1.2 < ch.imbalance
