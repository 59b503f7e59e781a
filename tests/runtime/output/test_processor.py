"""The output processor between the forward pass and the caller: new tokens reach a
request only at ``emit`` (after the scheduler's commit), stop rules, verify counts,
finishing once (the final output held until the engine has released the request), and the
errors a caller sees."""

from __future__ import annotations

from typing import Any

import torch

from runtime.constrained import GrammarMatcher
from runtime.model.runner import ForwardOutput
from runtime.output.processor import OutputProcessor
from runtime.output.request_output import FinishReason, RequestOutput
from runtime.output.state import StepTokens
from runtime.request import Request
from runtime.sampling.params import SamplingParams
from runtime.scheduler.batch import PrefillItem, ScheduledBatch, VerifyItem

VOCAB = 64
EOS = 2


class Recorder:
    """The callers' outputs, and what the engine would release (``EngineCore._settle``)."""

    def __init__(self) -> None:
        self.released: list[tuple[str, FinishReason | None]] = []
        self.outputs: list[RequestOutput] = []

    def settle(self, proc: OutputProcessor) -> None:
        finals = proc.take_finals()
        self.released += [(f.request.request_id, f.request.finish_reason) for f in finals]
        proc.send_finals(finals)


def _emit(proc: OutputProcessor, rec: Recorder, step: StepTokens) -> None:
    """One step's emit, then the engine's settle."""
    proc.emit(step)
    rec.settle(proc)


def _sampling(*reqs: Request) -> ScheduledBatch:
    """A batch in which each request computes its last known token, so it samples."""
    return ScheduledBatch.build(prefill=[PrefillItem(r, r.seq_len - 1, 1) for r in reqs])


class _Tok:
    """Decodes token t as the letter chr(ord('a') + t % 26)."""

    eos_token_id = EOS
    all_special_ids = [EOS]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids if t != EOS)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([t]) for t in ids]


class _Refuses(GrammarMatcher):
    """A grammar that admits no token at all."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0

    def accept_token(self, token_id: int) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        raise ValueError

    def is_terminated(self) -> bool:
        return False

    def can_end(self) -> bool:
        return False

    def forced_tokens(self) -> list[int]:
        return []


def _logits(*tokens: int) -> torch.Tensor:
    """Rows whose argmax is each token."""
    rows = torch.zeros(len(tokens), VOCAB)
    for i, t in enumerate(tokens):
        rows[i, t] = 10.0
    return rows


def _setup(**params: Any) -> tuple[OutputProcessor, Recorder, Request]:
    rec = Recorder()
    proc = OutputProcessor(_Tok(), [EOS], 100, torch.Generator().manual_seed(0), 16.0)
    req = Request("r", [1, 5, 6], SamplingParams(temperature=0.0, **params))
    proc.register(req, rec.outputs.append)
    return proc, rec, req


def _sampled(rid: str, *tokens: int) -> ForwardOutput:
    return ForwardOutput([rid], _logits(*tokens), {}, {})


def test_tokens_reach_the_request_only_at_emit() -> None:
    proc, rec, req = _setup(max_new_tokens=8)
    step = proc.sample(_sampling(req), _sampled("r", 7))
    assert req.output_ids == [] and not rec.outputs  # the scheduler commits in between
    _emit(proc, rec, step)
    assert req.output_ids == [7]
    assert [(o.delta_token_ids, o.finished) for o in rec.outputs] == [([7], False)]


def test_eos_finishes_once_and_releases_once() -> None:
    proc, rec, req = _setup(max_new_tokens=8, logprobs=True)
    _emit(proc, rec, proc.sample(_sampling(req), _sampled("r", EOS)))
    assert req.finish_reason == "stop" and req.output_ids == []
    assert rec.released == [("r", "stop")]
    final = rec.outputs[-1]
    assert final.finished and final.finish_reason == "stop" and final.logprobs == []
    proc.finish(req, "abort")  # a late abort changes nothing
    rec.settle(proc)
    assert rec.released == [("r", "stop")] and len(rec.outputs) == 1


def test_the_final_output_waits_until_the_engine_released_the_request() -> None:
    proc, rec, req = _setup(max_new_tokens=1)
    proc.emit(proc.sample(_sampling(req), _sampled("r", 9)))
    assert req.finish_reason == "length" and rec.outputs == []  # held: pages not released yet
    finals = proc.take_finals()
    assert [f.request for f in finals] == [req] and proc.take_finals() == []
    proc.send_finals(finals)
    assert [(o.token_ids, o.finish_reason) for o in rec.outputs] == [([9], "length")]


def test_length_and_max_new_tokens_zero() -> None:
    proc, rec, req = _setup(max_new_tokens=1)
    _emit(proc, rec, proc.sample(_sampling(req), _sampled("r", 9)))
    assert (req.output_ids, req.finish_reason) == ([9], "length")
    proc, rec, req = _setup(max_new_tokens=0, prompt_logprobs=True)
    step = proc.sample(_sampling(req), _sampled("r", 9))
    _emit(proc, rec, type(step)(step.new, [(req, [(1, -0.5), (2, -1.5)])]))
    assert (req.output_ids, req.finish_reason) == ([], "length")
    assert rec.outputs[-1].prompt_logprobs == [None, -0.5, -1.5]


def test_verify_accepts_matching_drafts_and_counts_them() -> None:
    proc, rec, req = _setup(max_new_tokens=8)
    req.output_ids.append(4)  # decoding: 4 is the newest token
    batch = ScheduledBatch.build(verify=[VerifyItem(req, (10, 11))])
    # Rows after 4, 10, 11: the model agrees with 10, then wants 12 instead of 11.
    out = ForwardOutput([], torch.zeros(0, VOCAB), {}, {"r": _logits(10, 12, 13)})
    step = proc.sample(batch, out)
    assert step.num_verified == {"r": 2} and req.output_ids == [4]
    _emit(proc, rec, step)
    assert req.output_ids == [4, 10, 12]
    assert (proc.spec.draft_tokens, proc.spec.accepted_tokens, proc.spec.verify_rounds) == (2, 1, 1)


def test_a_grammar_dead_end_aborts_with_a_message() -> None:
    proc, rec, req = _setup(max_new_tokens=8)
    proc.attach_matcher(req, _Refuses())
    _emit(proc, rec, proc.sample(_sampling(req), _sampled("r", 7)))
    assert req.finish_reason == "abort" and rec.released == [("r", "abort")]
    assert rec.outputs[-1].error == "the grammar admits no further token"


def test_a_failing_callback_does_not_stop_the_others() -> None:
    rec = Recorder()
    proc = OutputProcessor(_Tok(), [EOS], 100, torch.Generator().manual_seed(0), 16.0)

    def boom(_: RequestOutput) -> None:
        raise RuntimeError("caller bug")

    a = Request("a", [1], SamplingParams(temperature=0.0, max_new_tokens=4))
    b = Request("b", [1], SamplingParams(temperature=0.0, max_new_tokens=4))
    proc.register(a, boom)
    proc.register(b, rec.outputs.append)
    _emit(proc, rec, proc.sample(_sampling(a, b), ForwardOutput(["a", "b"], _logits(7, 8), {}, {})))
    assert a.output_ids == [7] and b.output_ids == [8] and rec.outputs[-1].token_ids == [8]


def _row(**scores: float) -> torch.Tensor:
    """One logits row: token id (as ``t<id>``) -> score, 0 elsewhere."""
    row = torch.zeros(1, VOCAB)
    for name, v in scores.items():
        row[0, int(name[1:])] = v
    return row


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    proc, rec, req = _setup(max_new_tokens=8, min_tokens=2, stop_token_ids=[9])
    for _ in range(2):  # EOS, then the stop id 9, are the favourites: both masked
        _emit(proc, rec, proc.sample(_sampling(req), ForwardOutput(["r"], _row(t2=10, t9=9, t7=5), {}, {})))
    assert req.output_ids == [7, 7] and req.finish_reason is None
    _emit(proc, rec, proc.sample(_sampling(req), ForwardOutput(["r"], _row(t2=10, t7=5), {}, {})))
    assert (req.output_ids, req.finish_reason) == ([7, 7], "stop")


def test_frequency_penalty_changes_the_greedy_choice() -> None:
    proc, rec, req = _setup(max_new_tokens=8, frequency_penalty=0.6)
    for _ in range(4):  # 7 leads 8 by 1: 7 twice (count 2 costs 1.2), then 8, then 7 again
        _emit(proc, rec, proc.sample(_sampling(req), ForwardOutput(["r"], _row(t7=10, t8=9), {}, {})))
    assert req.output_ids == [7, 7, 8, 7]


def test_verify_penalizes_each_row_as_if_earlier_drafts_were_appended() -> None:
    proc, rec, req = _setup(max_new_tokens=8, frequency_penalty=1.0)
    _emit(proc, rec, proc.sample(_sampling(req), _sampled("r", 4)))
    rows = torch.cat([_row(t7=10, t8=9.5)] * 3)
    step = proc.sample(ScheduledBatch.build(verify=[VerifyItem(req, (7, 7))]), ForwardOutput([], torch.zeros(0, VOCAB), {}, {"r": rows}))
    # Row 0 picks 7 (= draft 1); row 1 sees that 7, so 8 wins and draft 2 is rejected.
    assert step.num_verified == {"r": 2}
    _emit(proc, rec, step)
    assert req.output_ids == [4, 7, 8]


def test_verify_masks_eos_before_min_tokens() -> None:
    proc, rec, req = _setup(max_new_tokens=8, min_tokens=3)
    _emit(proc, rec, proc.sample(_sampling(req), _sampled("r", 4)))
    rows = torch.cat([_row(t2=10, t7=5)] * 3)
    _emit(proc, rec, proc.sample(ScheduledBatch.build(verify=[VerifyItem(req, (7, 7))]), ForwardOutput([], torch.zeros(0, VOCAB), {}, {"r": rows})))
    assert (req.output_ids, req.finish_reason) == ([4, 7, 7], "stop")  # EOS at position 3


def test_stop_regex_cuts_the_match_and_never_shows_it() -> None:
    proc, rec, req = _setup(max_new_tokens=20, stop_regex=[r"h+i"])
    for token in (0, 7, 1, 7, 7, 8, 3):  # a h b h h i d: "h" and "hh" are partial matches
        if req.finish_reason is None:
            _emit(proc, rec, proc.sample(_sampling(req), _sampled("r", token)))
    assert req.finish_reason == "stop" and rec.outputs[-1].text == "ahb"
    assert "".join(o.delta_text for o in rec.outputs) == "ahb"
    assert [o.delta_text for o in rec.outputs[:3]] == ["a", "", "hb"]  # "h" held back until "b"
