"""The speculation gate: drafts are verified only where acceptance pays for the measured
cost of verify rows; grammar-forced drafts always; declined drafts are shadowed, so a
request's acceptance keeps being learnt at no cost."""

from __future__ import annotations

import torch

from runtime.model.runner import ForwardOutput
from runtime.output.processor import OutputProcessor, tracked
from runtime.request import Request
from runtime.sampling.params import SamplingParams
from runtime.scheduler.batch import PrefillItem, ScheduledBatch, VerifyItem
from runtime.scheduler.cost_model import StepCostModel, StepShape
from runtime.speculative.gate import (
    MAX_BACKOFF_STEPS,
    Candidate,
    RequestSpeculation,
    Shadow,
    SourceStats,
    SpeculationGate,
)
from tests.runtime.output.test_processor import VOCAB, _logits, _Tok


def _costs(decode_s: float = 0.010, per_decode_row_s: float = 0.0005, extend_s: float = 0.030,
           per_extend_row_s: float = 0.002) -> StepCostModel:
    """A cost model that has seen steps costing exactly these (seconds)."""
    model = StepCostModel()
    for b in (1, 2, 4, 8, 16, 1, 3):
        model.observe(StepShape(decode_rows=b), decode_s + per_decode_row_s * b)
    for d, p, v in ((0, 300, 0), (4, 16, 0), (0, 0, 9), (2, 0, 18), (1, 8, 5), (0, 64, 0)):
        model.observe(StepShape(d, p, v), extend_s + per_decode_row_s * d + per_extend_row_s * (p + v))
    return model


def _stats(accepted: int, rejections: int) -> SourceStats:
    return SourceStats(accepted=accepted, rejections=rejections)


def test_expected_accepted_follows_the_geometric_model() -> None:
    s = _stats(2, 2)  # q = 3 / 6
    assert s.acceptance == 0.5
    assert abs(s.expected_accepted(3) - (0.5 + 0.25 + 0.125)) < 1e-12


def test_costly_verify_rows_stop_poorly_accepted_drafts() -> None:
    """Alone, a verify pass costs 3.9x a decode step here: text accepted at 1 in 12 is not
    drafted, text that echoes its prompt (accepted 48 of 50) is, at full length."""
    gate = SpeculationGate(_costs(), fixed_cost_rows=16.0)
    assert gate.choose(1, [Candidate("r", 8, _stats(1, 11))]) == {}
    assert gate.choose(1, [Candidate("r", 8, _stats(48, 2))]) == {"r": 8}


def test_cheap_verify_rows_make_even_modest_acceptance_pay() -> None:
    gate = SpeculationGate(_costs(extend_s=0.010, per_extend_row_s=0.0005), fixed_cost_rows=16.0)
    assert gate.choose(1, [Candidate("r", 8, _stats(3, 7))]) != {}


def test_draft_length_is_cut_where_more_rows_stop_paying() -> None:
    gate = SpeculationGate(_costs(extend_s=0.008, per_extend_row_s=0.0015), fixed_cost_rows=16.0)
    chosen = gate.choose(1, [Candidate("r", 8, _stats(6, 4))])  # q = 0.58
    assert 1 <= chosen["r"] < 8


def test_forced_drafts_are_always_verified() -> None:
    gate = SpeculationGate(_costs(extend_s=0.5, per_extend_row_s=0.05), fixed_cost_rows=16.0)
    chosen = gate.choose(2, [Candidate("json", 5, None), Candidate("text", 8, _stats(1, 11))])
    assert chosen == {"json": 5}


def test_a_step_that_verifies_anyway_charges_lookups_only_their_rows() -> None:
    """Forced drafts take the step off the decode-only path; a poorly accepted lookup
    then costs only its extra rows, which its expected gain can cover."""
    gate = SpeculationGate(_costs(extend_s=0.5), fixed_cost_rows=16.0)
    assert gate.choose(1, [Candidate("text", 8, _stats(45, 4))]) == {}
    chosen = gate.choose(2, [Candidate("json", 2, None), Candidate("text", 8, _stats(45, 4))])
    assert chosen["json"] == 2 and chosen["text"] >= 1


def test_batch_size_raises_the_bar() -> None:
    """Unmeasured, the prior (a pass costs 16 rows plus one a row) tries a fresh request's
    drafts alone but not among 16 decoding requests, where even drafts that are all
    accepted would not pay enough to be proposed."""
    gate = SpeculationGate(StepCostModel(), fixed_cost_rows=16.0)
    assert 1 <= gate.choose(1, [Candidate("r", 8, SourceStats())])["r"] <= 8
    assert gate.choose(16, [Candidate("r", 8, SourceStats())]) == {}
    assert gate.worth_proposing(1, 8) and not gate.worth_proposing(16, 8)


def test_lookup_waits_until_the_decode_only_regime_is_measured() -> None:
    costs = StepCostModel()
    for n in (100, 200, 300):
        costs.observe(StepShape(prefill_tokens=n), 0.001 * n)
    gate = SpeculationGate(costs, fixed_cost_rows=16.0)
    assert gate.choose(1, [Candidate("r", 8, _stats(48, 2))]) == {}
    assert not gate.worth_proposing(1, 8)


def test_a_shadow_round_resolves_at_the_first_mismatch_or_when_all_matched() -> None:
    shadow = Shadow("lookup", (7, 8, 9), start=2)
    assert shadow.resolve([1, 4]) is None
    assert shadow.resolve([1, 4, 7, 8]) is None
    assert shadow.resolve([1, 4, 7, 5]) == (3, 1)
    assert shadow.resolve([1, 4, 7, 8, 9, 3]) == (3, 3)


def test_lookup_proposals_back_off_after_misses_and_resume_on_a_hit() -> None:
    spec = RequestSpeculation()
    spec.record("lookup", 4, 0)
    assert spec.may_propose()  # one miss: keep proposing
    spec.record("lookup", 4, 0)
    assert [spec.may_propose() for _ in range(3)] == [False, False, True]  # 2 misses: skip 2
    spec.record("lookup", 4, 0)
    assert [spec.may_propose() for _ in range(5)] == [False] * 4 + [True]  # 3 misses: skip 4
    for _ in range(10):
        spec.record("lookup", 4, 0)
    assert spec.skip_steps == MAX_BACKOFF_STEPS
    spec.skip_steps = 0
    spec.record("text_lookup", 4, 2)
    assert spec.num_misses == 0 and spec.may_propose()


def _processor(costs: StepCostModel) -> tuple[OutputProcessor, Request]:
    proc = OutputProcessor(_Tok(), [2], 1000, torch.Generator().manual_seed(0), 16.0, costs)
    proc.proposer.text_lookup = None  # token n-grams only: the fake tokenizer cannot encode
    req = Request("r", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], SamplingParams(temperature=0.0, max_new_tokens=200))
    proc.register(req, None)
    return proc, req


def _run(proc: OutputProcessor, req: Request, next_token: list[int], steps: int) -> int:
    """``steps`` steps of one decoding request whose model emits ``next_token[i]`` at output
    position i; returns the verify rounds."""
    rounds = 0
    for _ in range(steps):
        drafts = proc.propose_drafts([req])
        pos = len(req.output_ids)
        if drafts.get("r"):
            rounds += 1
            rows = _logits(*next_token[pos : pos + len(drafts["r"]) + 1])
            batch = ScheduledBatch.build(verify=[VerifyItem(req, tuple(drafts["r"]))])
            step = proc.sample(batch, ForwardOutput([], torch.zeros(0, VOCAB), {}, {"r": rows}))
        else:
            batch = ScheduledBatch.build(prefill=[PrefillItem(req, req.seq_len - 1, 1)])  # samples one token
            step = proc.sample(batch, ForwardOutput(["r"], _logits(next_token[pos]), {}, {}))
        proc.emit(step)
    return rounds


def test_output_that_does_not_echo_its_prompt_stops_drafting_quickly() -> None:
    """Under the prior (costs unmeasured, where a wasted draft row is cheap) drafts are
    tried; once they keep failing, verified or in shadow, the request decodes plainly,
    never differently. With measured costs where verify rows are dear, it never drafts."""
    proc, req = _processor(StepCostModel())
    # The output keeps restarting n-grams of its prompt and its own past, but never
    # continues them as before: every third token starts a lookup draft, and it fails.
    pairs = [(5, 6), (7, 8), (9, 10)]
    text = [t for i in range(140) for t in (*pairs[i % 3], 20 + (i * 7) % 44)]
    req.output_ids.append(text[0])
    rounds = _run(proc, req, [0, *text[1:]], 60)
    assert req.output_ids[: len(text)] == text[: len(req.output_ids)]
    assert 1 <= rounds <= 8
    assert _run(proc, req, [0, *text[1:]], 40) == 0
    spec = tracked(req).speculation
    # Shadow rounds kept counting, ever more rarely (backoff: proposing has a cost too).
    assert spec.stats("lookup").rejections >= 8 and spec.num_misses >= 8
    proc, req = _processor(_costs())
    req.output_ids.append(text[0])
    assert _run(proc, req, [0, *text[1:]], 60) == 0
    assert req.output_ids == text[:61]


def test_output_that_echoes_its_prompt_keeps_drafting() -> None:
    proc, req = _processor(_costs())
    echo = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 30
    req.output_ids.append(echo[0])
    _run(proc, req, [0, *echo[1:]], 20)
    assert len(req.output_ids) > 60 and req.output_ids == echo[: len(req.output_ids)]
    spec = tracked(req).spec
    assert spec.verify_rounds >= 5 and spec.accepted_tokens > 0.8 * spec.draft_tokens
