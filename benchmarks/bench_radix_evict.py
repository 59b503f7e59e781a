"""Radix-tree eviction with the evictable-leaf heap vs choosing the victim by a tree walk.

A warm prefix cache holds many leaves; once it fills the pool, admissions and decode steps
evict every time they need pages. ``RadixTree.evict`` keeps its evictable leaves in a set
and a lazily refreshed heap, so one eviction costs a heap pop. The baseline is what it did
before: walk every node to collect the unlocked leaves, heapify them by last access and
pop the oldest (timed here without freeing anything, so it is a lower bound of that cost).

The tree: ``--leaves`` requests that share a 64-token system prompt, each with 128 tokens
of its own (page size 16). Each case times single-page evictions (median of ``--repeats``)
on the same tree, then the inserts that built it (their per-insert cost includes keeping
the set and heap).

    .venv/bin/python benchmarks/bench_radix_evict.py [--leaves 500 5000 20000] [--repeats 200]
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, reproduce_line, save_result, time_call  # noqa: E402

from runtime.cache.page_pool import PagePool  # noqa: E402
from runtime.cache.radix_tree import RadixTree  # noqa: E402

PAGE_SIZE, SHARED, OWN = 16, 64, 128


def build(num_leaves: int) -> tuple[RadixTree, float]:
    """The tree, and seconds per insert (match, lock, allocate, cache_finished)."""
    pool = PagePool(num_leaves * (OWN // PAGE_SIZE) + SHARED // PAGE_SIZE + 1, PAGE_SIZE)
    tree = RadixTree(pool)
    start = time.perf_counter()
    for i in range(num_leaves):
        tokens = list(range(SHARED)) + [100_000 + i] * OWN
        match = tree.match_prefix(tokens)
        tree.lock(match)
        own = pool.allocate(len(tokens) // PAGE_SIZE - len(match.pages))
        tree.cache_finished(tokens, match.pages + own, match)
    return tree, (time.perf_counter() - start) / num_leaves


def walk_victim(tree: RadixTree) -> Any:
    """The old way: every node visited, unlocked leaves heapified, the oldest popped."""
    nodes, stack = [], [tree.root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    heap = [(n.last_access, id(n), n) for n in nodes if not n.children and n is not tree.root
            and n.lock_ref == 0]
    heapq.heapify(heap)
    return heapq.heappop(heap)[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaves", type=int, nargs="+", default=[500, 5000, 20000])
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    print(reproduce_line())
    print(f"{'leaves':>7} {'walk us':>10} {'heap us':>9} {'ratio':>9} {'insert us':>10}")
    rows = []
    for n in args.leaves:
        tree, per_insert = build(n)
        walk = time_call(lambda tree=tree: walk_victim(tree), args.repeats)
        heap = time_call(lambda tree=tree: tree.evict(1), args.repeats)
        tree.check_integrity()
        rows.append({"leaves": n, "walk_us": walk * 1e6, "heap_us": heap * 1e6,
                     "ratio": walk / heap, "insert_us": per_insert * 1e6})
        print(f"{n:>7} {walk * 1e6:>10.1f} {heap * 1e6:>9.1f} {walk / heap:>8.0f}x {per_insert * 1e6:>10.1f}")
    print(f"load average: {load_average()}")
    print(f"saved {save_result('bench_radix_evict', {'rows': rows})}")


if __name__ == "__main__":
    main()
