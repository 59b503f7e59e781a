"""Prefill budgets from latency targets: the budget decision against a cost model that has
seen exact step times, and, in the scheduler with a virtual clock, a tighter ITL target
giving a lower ITL p99 and a higher TTFT."""

from __future__ import annotations

import logging

import pytest

from runtime.cli import build_parser
from runtime.config import DEFAULT_ITL_SLO_STEPS, EngineConfig
from runtime.errors import InvalidRequestError
from runtime.request import Request
from runtime.sampling.params import SamplingParams
from runtime.scheduler.budget import FixedBudget, LatencyTargetBudget, prefill_budget
from runtime.scheduler.cost_model import StepCostModel, StepShape
from tests.runtime.scheduler.sim import Sim


def step_seconds(shape: StepShape) -> float:
    """The fake machine: a decode-only step 10 ms + 1 ms a row; a step with prefill 14 ms
    + 1 ms a decode row + 0.1 ms a prompt token."""
    if shape.regime == "decode":
        return 0.010 + 0.001 * shape.decode_rows
    return 0.014 + 0.001 * shape.decode_rows + 0.0001 * (shape.prefill_tokens + shape.verify_rows)


def trained() -> StepCostModel:
    model = StepCostModel()
    for d in (1, 2, 4, 8, 3):
        model.observe(StepShape(decode_rows=d), step_seconds(StepShape(decode_rows=d)))
    for d, p in ((0, 300), (4, 16), (2, 64), (8, 128), (1, 512)):
        model.observe(StepShape(d, p), step_seconds(StepShape(d, p)))
    return model


def _req(rid: str, prompt_len: int, arrival_s: float = 0.0, **params: float) -> Request:
    r = Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=8, **params))  # type: ignore[arg-type]
    r.arrival_s = arrival_s
    return r


def _decoding(n: int) -> list[Request]:
    out = []
    for i in range(n):
        r = _req(f"d{i}", 4)
        r.output_ids.append(7)
        r.num_computed = r.seq_len - 1
        out.append(r)
    return out


def budget(itl: float | None = None, ttft: float | None = None, now: float = 0.0,
           cost: StepCostModel | None = None) -> LatencyTargetBudget:
    return LatencyTargetBudget(cost or trained(), itl, ttft, min_chunk=16, max_tokens=2048, clock=lambda: now)


def test_without_targets_it_budgets_as_the_fixed_chunk() -> None:
    fixed, sized = FixedBudget(16, 2048), budget()
    for decoding in ([], _decoding(1), _decoding(8)):
        for waiting in ([], [_req("w", 900)]):
            assert sized.tokens(decoding, waiting) == fixed.tokens(decoding, waiting)


def test_itl_target_sizes_the_chunk_from_the_cost_model() -> None:
    """4 streams: 18 ms + 0.1 ms a prompt token; 30 ms leaves 120 tokens, 20 ms 20."""
    decoding, waiting = _decoding(4), [_req("w", 900)]
    assert budget(itl=0.030).tokens(decoding, waiting) == pytest.approx(120, abs=1)
    assert budget(itl=0.020).tokens(decoding, waiting) == pytest.approx(20, abs=1)
    assert budget(itl=1.0).tokens(decoding, waiting) == 2048  # nothing at risk: the ceiling
    assert budget(itl=0.030).tokens([], waiting) == 2048  # nothing decodes
    tight = _decoding(4)
    tight[0] = _req("own", 4, itl_slo=0.020)
    tight[0].output_ids.append(7)
    tight[0].num_computed = tight[0].seq_len - 1
    assert budget(itl=0.030).tokens(tight, waiting) == pytest.approx(20, abs=1)  # the request's own wins


def test_unreachable_itl_target_keeps_prefill_moving_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    b = budget(itl=0.005)  # below a bare decode step
    with caplog.at_level(logging.WARNING, logger="arbor.scheduler"):
        assert b.tokens(_decoding(4), [_req("w", 900)]) == 16
        assert b.tokens(_decoding(4), [_req("w", 900)]) == 16
    assert len([r for r in caplog.records if "ITL target" in r.getMessage()]) == 1


def test_unmeasured_costs_give_the_fixed_chunk() -> None:
    assert budget(itl=0.030, ttft=0.5, cost=StepCostModel()).tokens(_decoding(4), [_req("w", 900)]) == 16


def test_a_prompt_near_its_ttft_target_gets_the_tokens_it_needs() -> None:
    """TTFT 1 s, steps of ~19.6 ms: 900 tokens arriving now spread over ~51 steps; the
    same prompt 0.9 s old has 5 steps left; 2 s old it is late: all of it now."""
    decoding = _decoding(4)
    assert budget(ttft=1.0, now=0.0).tokens(decoding, [_req("w", 900)]) == 18
    assert budget(ttft=1.0, now=0.9).tokens(decoding, [_req("w", 900)]) == 180
    assert budget(ttft=1.0, now=2.0).tokens(decoding, [_req("w", 900)]) == 900
    # A prompt queued behind another counts the tokens ahead of it: alone, 900 tokens
    # with 20 steps left need 45 a step; behind 100 older ones, 50.
    assert budget(ttft=1.0, now=0.9).tokens(decoding, [_req("a", 900, arrival_s=0.3)]) == 45
    assert budget(ttft=1.0, now=0.9).tokens(decoding, [_req("a", 900, arrival_s=0.3), _req("b", 100)]) == 50


def _serve(itl_slo: float | None, ttft_slo: float | None = None, itl_stretch: float = 2.0,
           gap: str = "p99", itl_steps: float | None = None) -> tuple[float, float]:
    """Streams decode while long prompts arrive; returns (ITL p99, or the longest gap, and
    mean TTFT) in seconds of the fake machine's virtual time."""
    now = [0.0]
    cost = trained()
    sim = Sim(num_pages=20000, prefix_cache=False, max_running=64, max_prefill_tokens=2048, chunked_prefill_size=16,
              budget=LatencyTargetBudget(cost, itl_slo, ttft_slo, 16, 2048, clock=lambda: now[0],
                                         itl_stretch=itl_stretch, itl_steps=itl_steps),
              clock=lambda: now[0])
    for i in range(4):
        sim.add(f"s{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 37)), 200)  # distinct: no cache hits
    arrivals = {step: f"p{step}" for step in range(20, 200, 30)}
    last: dict[str, float] = {}
    gaps: list[float] = []
    first: dict[str, float] = {}
    added: dict[str, float] = {}
    step = 0
    while sim.sched.has_work:
        if step in arrivals:
            added[arrivals[step]] = now[0]
            sim.add(arrivals[step], list(range(10000 * step, 10000 * step + 600)), 16)
        batch = sim.step()
        now[0] += step_seconds(batch.shape)
        for r in [i.request for i in batch.prefill if i.completes] + batch.decode:
            rid = r.request_id
            if rid in last:
                gaps.append(now[0] - last[rid])
            elif rid in added:
                first[rid] = now[0] - added[rid]
            last[rid] = now[0]
        step += 1
    gaps.sort()
    return gaps[int(0.99 * (len(gaps) - 1)) if gap == "p99" else -1], sum(first.values()) / len(first)


def test_a_tighter_itl_target_gives_lower_itl_p99_and_higher_ttft() -> None:
    loose_itl, loose_ttft = _serve(itl_slo=0.080)
    tight_itl, tight_ttft = _serve(itl_slo=0.025)
    assert tight_itl < loose_itl and tight_ttft > loose_ttft
    assert tight_itl <= 0.025 + 1e-9  # the target held, on the machine the model learnt


def test_a_late_prompt_stretches_a_step_to_at_most_itl_stretch_times_the_target() -> None:
    """ITL 30 ms, 4 streams decoding (steps of 18 ms + 0.1 ms a prompt token): the ITL
    rule allows 120 prompt tokens; a late 900-token prompt asks for all 900 (a 108 ms
    step), and gets 420 (a 60 ms step, 2 x 30 ms); a prompt that needs less than the cap
    gets what it needs; with no ITL target the late prompt still gets all of it."""
    decoding = _decoding(4)
    assert budget(itl=0.030, now=2.0).tokens(decoding, [_req("w", 900)]) == 120
    assert abs(budget(itl=0.030, ttft=1.0, now=2.0).tokens(decoding, [_req("w", 900)]) - 420) <= 1  # a fit
    assert budget(itl=0.030, ttft=1.0, now=0.9).tokens(decoding, [_req("w", 900)]) == 180
    assert budget(ttft=1.0, now=2.0).tokens(decoding, [_req("w", 900)]) == 900
    unbounded = LatencyTargetBudget(trained(), 0.030, 1.0, 16, 2048, clock=lambda: 2.0, itl_stretch=1e6)
    assert unbounded.tokens(decoding, [_req("w", 900)]) == 900  # the rule before the cap


def test_late_prompts_no_longer_stall_running_streams() -> None:
    """A TTFT target (30 ms) no 600-token prompt can meet in small chunks: each one asks
    for all its tokens at once. Without the cap that step stalls the running streams
    (a gap of 78 ms); with it no gap passes 2 x the 25 ms ITL target, and the TTFT target
    still buys a lower TTFT than the ITL target alone."""
    stalled, _ = _serve(itl_slo=0.025, ttft_slo=0.03, itl_stretch=1e6, gap="max")
    capped, capped_ttft = _serve(itl_slo=0.025, ttft_slo=0.03, gap="max")
    _, itl_only_ttft = _serve(itl_slo=0.025)
    assert stalled > 0.070
    assert capped <= 2 * 0.025 + 1e-9
    assert capped_ttft < itl_only_ttft


def test_bad_targets_are_refused_at_start() -> None:
    for bad in ({"itl_slo": 0.0}, {"ttft_slo": -1.0}, {"ttft_slo": 0.01, "itl_slo": 0.05}):
        with pytest.raises(InvalidRequestError, match="slo"):
            EngineConfig(**bad)  # type: ignore[arg-type]
    for stretch in (0.5, -1.0):
        with pytest.raises(InvalidRequestError, match="itl_stretch"):
            EngineConfig(itl_stretch=stretch)
    with pytest.raises(InvalidRequestError, match="itl_slo"):
        SamplingParams(itl_slo=0)
    args = build_parser().parse_args(["serve", "--itl-slo", "0.05", "--ttft-slo", "2"])
    assert (args.itl_slo, args.ttft_slo) == (0.05, 2.0)


def test_an_itl_target_in_decode_steps_follows_the_measured_decode_step() -> None:
    """One stream decodes in 11 ms: 4 steps are 44 ms. With 4 streams decoding a step with
    prefill takes 18 ms + 0.1 ms a token: 260 tokens; with 8, 22 ms + 0.1 ms: 220. With 2
    steps (22 ms) the floor of two batch steps wins: 4 streams decode in 14 ms, so 28 ms
    and 100 tokens; 8 streams in 18 ms, so 36 ms and 140 tokens."""
    waiting = [_req("w", 900)]
    relative = LatencyTargetBudget(trained(), None, None, 16, 2048, itl_steps=4.0)
    assert relative.tokens(_decoding(4), waiting) == pytest.approx(260, abs=1)
    assert relative.tokens(_decoding(8), waiting) == pytest.approx(220, abs=1)
    assert relative.tokens([], waiting) == 2048  # nothing decodes
    floored = LatencyTargetBudget(trained(), None, None, 16, 2048, itl_steps=2.0)
    assert floored.tokens(_decoding(4), waiting) == pytest.approx(100, abs=1)
    assert floored.tokens(_decoding(8), waiting) == pytest.approx(140, abs=1)
    own = _decoding(4)
    own[0] = _req("own", 4, itl_slo=0.020)
    own[0].output_ids.append(7)
    own[0].num_computed = own[0].seq_len - 1
    assert relative.tokens(own, waiting) == pytest.approx(20, abs=1)  # the request's own wins
    seconds = LatencyTargetBudget(trained(), 0.030, None, 16, 2048, itl_steps=4.0)
    assert seconds.tokens(_decoding(4), waiting) == pytest.approx(120, abs=1)  # seconds win over steps


def test_an_itl_target_in_decode_steps_waits_for_measured_decode_steps() -> None:
    """Only steps with prefill measured: no decode step to scale, so the fixed chunk."""
    cost = StepCostModel()
    for d, p in ((0, 300), (4, 16), (2, 64), (8, 128)):
        cost.observe(StepShape(d, p), step_seconds(StepShape(d, p)))
    assert LatencyTargetBudget(cost, None, None, 16, 2048, itl_steps=8.0).tokens(_decoding(4), [_req("w", 900)]) == 16


def test_a_tighter_target_in_decode_steps_gives_lower_itl_p99_and_higher_ttft() -> None:
    loose_itl, loose_ttft = _serve(itl_slo=None, itl_steps=6.0)
    tight_itl, tight_ttft = _serve(itl_slo=None, itl_steps=2.0)
    assert tight_itl < loose_itl and tight_ttft > loose_ttft
    fixed_itl, fixed_ttft = _serve(itl_slo=None)  # no target: the fixed chunk
    assert loose_ttft < fixed_ttft and tight_ttft < fixed_ttft


def test_the_default_is_a_target_in_decode_steps_unless_the_user_chose_a_chunk_or_target() -> None:
    cost = trained()
    default = EngineConfig().for_device("cpu")
    assert default.itl_slo_steps == DEFAULT_ITL_SLO_STEPS
    assert prefill_budget(default, cost).tokens(_decoding(4), [_req("w", 900)]) > 16
    for chosen in ({"chunked_prefill_size": 16}, {"itl_slo": 0.05}, {"ttft_slo": 1.0}):
        assert EngineConfig(**chosen).for_device("cpu").itl_slo_steps is None  # type: ignore[arg-type]
    fixed = prefill_budget(EngineConfig(chunked_prefill_size=16).for_device("cpu"), cost)
    assert fixed.tokens(_decoding(4), [_req("w", 900)]) == 16  # the old behaviour
    both = EngineConfig(ttft_slo=1.0, itl_slo_steps=4, chunked_prefill_size=32).for_device("cpu")
    assert (both.itl_slo_steps, both.chunked_prefill_size) == (4, 32)
    assert default.for_device("cpu").itl_slo_steps == DEFAULT_ITL_SLO_STEPS  # idempotent


def test_bad_targets_in_decode_steps_are_refused() -> None:
    for bad in (1.0, 0.5, 0, -2.0, "8"):
        with pytest.raises(InvalidRequestError, match="itl_slo_steps must be a number > 1"):
            EngineConfig(itl_slo_steps=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="not both"):
        EngineConfig(itl_slo=0.2, itl_slo_steps=8)
    args = build_parser().parse_args(["serve", "--itl-slo-steps", "4"])
    assert args.itl_slo_steps == 4.0
