"""Penalties and min_tokens on logits: the OpenAI formulas and HF's repetition penalty,
checked against a per-token reference and against HF's own logits processor."""

from __future__ import annotations

import pytest
import torch

from runtime.sampling.params import SamplingParams
from runtime.sampling.penalties import TokenHistory, apply_penalties, suppress_stop_ids

VOCAB = 40


def reference(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The documented semantics, one token at a time (vLLM's order: repetition first)."""
    out = row.clone()
    for t in set(prompt) | set(output):
        v = out[t].item()
        out[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for t in set(output):
        out[t] -= output.count(t) * p.frequency_penalty + p.presence_penalty
    return out


def history(prompt: list[int], output: list[int]) -> TokenHistory:
    h = TokenHistory(prompt)
    for t in output:
        h.add(t)
    return h


CASES = [
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-1.5),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=2.0),
    SamplingParams(),  # no penalty: the row is untouched
]


def test_batch_matches_the_reference_row_by_row() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB, generator=gen) * 3
    prompts = [torch.randint(0, VOCAB, (12,), generator=gen).tolist() for _ in CASES]
    outputs = [torch.randint(0, VOCAB, (30,), generator=gen).tolist() for _ in CASES]
    expected = torch.stack([reference(logits[i], p, prompts[i], outputs[i]) for i, p in enumerate(CASES)])
    got = logits.clone()
    apply_penalties(got, CASES, [history(pr, o) for pr, o in zip(prompts, outputs, strict=True)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(got[-1], logits[-1])
    assert not torch.equal(got[:-1], logits[:-1])


def test_rows_without_history_are_untouched() -> None:
    logits = torch.randn(2, VOCAB)
    got = logits.clone()
    apply_penalties(got, [SamplingParams(frequency_penalty=1.0)] * 2, [None, history([], [])])
    assert torch.equal(got, logits)  # no history, and an empty one


@pytest.mark.parametrize("penalty", [0.5, 1.2, 2.0])
def test_repetition_matches_hf_logits_processor(penalty: float) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, VOCAB, generator=gen) * 4
    prompt = torch.randint(0, VOCAB, (15,), generator=gen).tolist()
    output = torch.randint(0, VOCAB, (10,), generator=gen).tolist()
    expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone())
    got = logits.clone()
    apply_penalties(got, [SamplingParams(repetition_penalty=penalty)], [history(prompt, output)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_pending_tokens_count_as_appended() -> None:
    """Verification adjusts position i as if the drafts before it were appended."""
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.1)]
    logits = torch.randn(1, VOCAB)
    pending_way, appended_way = logits.clone(), logits.clone()
    apply_penalties(pending_way, params, [history([1, 2], [3, 3])], pending=[[3, 7]])
    apply_penalties(appended_way, params, [history([1, 2], [3, 3, 3, 7])])
    assert torch.equal(pending_way, appended_way)


def test_suppress_stop_ids() -> None:
    logits = torch.zeros(3, VOCAB)
    suppress_stop_ids(logits, [0, 2], [[2, 5], [2]])
    assert torch.isneginf(logits).nonzero().tolist() == [[0, 2], [0, 5], [2, 2]]


def test_suppress_stop_ids_leaves_an_ended_grammar_alone() -> None:
    """A grammar that allows nothing but a stop id has ended; min_tokens does not outlast it."""
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 2] = 1.0
    suppress_stop_ids(logits, [0], [[2, 5]])
    assert logits[0, 2] == 1.0
