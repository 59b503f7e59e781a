"""The shadow comparison of two answers, and the bounded shadow queue."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from runtime.eval.replay import greedy_match, mean_kl
from runtime.eval.targets import Generation, PositionDists
from runtime.router.rollout_plan import ShadowSettings
from runtime.router.shadow import PairComparison, ShadowJob, ShadowRunner, compare_pair

GREEDY = {"text": "x", "sampling_params": {"temperature": 0.0, "top_logprobs": 3}}


def answer(ids: list[int], tops: list[dict[int, float]] | None = None, valid: bool | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"prompt_tokens": 3, "completion_tokens": len(ids), "cached_tokens": 0}
    if tops is not None:
        meta["top_logprobs"] = [{str(t): lp for t, lp in top.items()} for top in tops]
    if valid is not None:
        meta["constraint_check"] = {"valid": valid, "checked": True}
    return {"text": "", "output_ids": ids, "finish_reason": "length", "meta": meta}


def top(*pairs: tuple[int, float]) -> dict[int, float]:
    return dict(pairs)


def test_identical_greedy_answers_match_exactly() -> None:
    tops = [top((5, -0.1), (6, -2.5)), top((7, -0.2), (8, -1.9))]
    pair = compare_pair(GREEDY, answer([5, 7], tops, valid=True), answer([5, 7], tops, valid=True))
    assert pair == PairComparison(True, True, None, 1.0, True, True, 1.0, 0.0, 2)


def test_divergence_length_validity_and_kl_over_the_shared_positions() -> None:
    base_tops = [top((5, -0.1), (6, -2.5)), top((7, -0.3), (8, -1.5)), top((9, -0.1), (1, -3.0))]
    cand_tops = [top((5, -0.2), (6, -1.8)), top((8, -0.4), (7, -1.2)), top((2, -0.1), (3, -3.0))]
    pair = compare_pair(GREEDY, answer([5, 7, 9], base_tops, valid=True), answer([5, 8, 2, 3], cand_tops, valid=False))
    assert (pair.exact, pair.first_divergence, pair.kl_positions) == (False, 1, 2)
    assert (pair.base_valid, pair.cand_valid) == (True, False)
    assert pair.length_ratio == pytest.approx(4 / 3) and pair.prefix_share == pytest.approx(1 / 3)
    # NOTE: the same figure ``arbor eval`` computes from the same top-k (its server path)
    dists = [PositionDists(torch.tensor([list(t) for t in tops[:2]]), torch.tensor([list(t.values()) for t in tops[:2]]),
                           None) for tops in (base_tops, cand_tops)]
    eval_kl, method = mean_kl(dists[0], dists[1])
    assert method == "top-2" and pair.kl == pytest.approx(eval_kl)
    by_hand = (math.exp(-0.1) * (-0.1 + 0.2) + math.exp(-2.5) * (-2.5 + 1.8)
               + math.exp(-0.3) * (-0.3 + 1.2) + math.exp(-1.5) * (-1.5 + 0.4)) / 2
    assert pair.kl == pytest.approx(by_hand)
    same, prefix = greedy_match([Generation([5, 7, 9], "")], [Generation([5, 8, 2, 3], "")])
    assert (same, prefix) == (0.0, pair.prefix_share)


def test_sampled_requests_and_answers_without_logprobs() -> None:
    pair = compare_pair({"text": "x"}, answer([1, 2]), answer([1, 2]))
    assert (pair.greedy, pair.exact, pair.kl, pair.base_valid) == (False, True, None, None)


def test_the_shadow_queue_is_capped_and_yields_to_users() -> None:
    async def run() -> tuple[dict[str, int], list[PairComparison]]:
        gate = asyncio.Event()
        users = [0]
        pairs: list[PairComparison] = []

        async def send(job: ShadowJob) -> dict[str, Any] | None:
            await gate.wait()
            return answer([1, 2])

        runner = ShadowRunner(ShadowSettings(share=0.5, queue_cap=2, max_user_inflight=3), send, pairs.append,
                              lambda: users[0])
        assert [runner.wants() for _ in range(6)] == [False, True, False, True, False, True]
        runner.start()
        job = ShadowJob(GREEDY, [], answer([1, 2]))
        runner.offer(job)
        await asyncio.sleep(0.01)  # NOTE: the first job is taken (and waits on the gate)
        assert runner.offer(job) and runner.offer(job) and not runner.offer(job)  # cap 2
        users[0] = 4
        assert not runner.offer(job)  # users above max_user_inflight: dropped first
        users[0] = 0
        gate.set()
        await runner.drain()
        await runner.stop()
        return dict(runner.counts), pairs

    counts, pairs = asyncio.run(run())
    assert counts == {"offered": 5, "sent": 3, "compared": 3, "dropped_full": 1, "dropped_load": 1}
    assert len(pairs) == 3 and all(p.exact for p in pairs)
