"""Penalties, min_tokens and stop_regex through the whole engine: greedy tokens equal a
reference decoding loop over HF's model (and HF ``generate`` for the repetition penalty);
min_tokens and stop_regex end requests where they should (speculation with penalties:
tests/runtime/speculative)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runtime import Engine, SamplingParams

PROMPTS = [[1, 40, 50, 60, 40, 50, 60, 40, 50], [1, 300, 301, 302, 303]]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    eng = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=1024, max_model_len=256)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def reference_greedy(model: torch.nn.Module, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding with the penalties written out token by token."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(p.max_new_tokens):
            row = model(torch.tensor([prompt + out])).logits[0, -1].float()  # type: ignore[operator]
            for t in set(prompt) | set(out):
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
            for t in set(out):
                row[t] -= out.count(t) * p.frequency_penalty + p.presence_penalty
            out.append(int(row.argmax()))
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=1.5),
    SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, presence_penalty=2.0, frequency_penalty=0.5),
    SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.8),
])
def test_greedy_penalized_tokens_match_the_reference(engine: Engine, hf_model: torch.nn.Module,
                                                     params: SamplingParams) -> None:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    plain = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
        max_new_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out, base in zip(PROMPTS, outs, plain, strict=True):
        assert out.token_ids == reference_greedy(hf_model, prompt, params)
        assert out.token_ids != base.token_ids  # the penalty changed something
    engine.wait_idle()
    engine.check_integrity()


def test_repetition_penalty_matches_hf_generate(engine: Engine, hf_model: torch.nn.Module) -> None:
    prompt = PROMPTS[0]
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,  # type: ignore[operator]
                                repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
    out = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.5))[0]
    assert out.token_ids == ref[0, len(prompt):].tolist()


def test_min_tokens_and_stop_regex_in_the_engine(engine: Engine) -> None:
    eos = engine.eos_token_ids[0]
    # Force EOS as the only choice by a stop id that is everything the model picks first.
    base = engine.generate(input_ids=[PROMPTS[1]], sampling_params=SamplingParams(
        max_new_tokens=12, temperature=0.0, ignore_eos=True))[0]
    first = base.token_ids[0]
    out = engine.generate(input_ids=[PROMPTS[1]], sampling_params=SamplingParams(
        max_new_tokens=12, temperature=0.0, stop_token_ids=[first], min_tokens=5))[0]
    assert len(out.token_ids) >= 5 and first not in out.token_ids[:5] and eos not in out.token_ids
    text = base.text
    cut = engine.generate(input_ids=[PROMPTS[1]], sampling_params=SamplingParams(
        max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_regex=[re.escape(text[3:6])]))[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(text[3:6])]


def test_penalties_and_min_tokens_compose_with_a_grammar(engine: Engine) -> None:
    import grammars

    digits = grammars.RegexConstraint("[0-9]{8}")
    out = engine.generate(input_ids=[PROMPTS[1]], sampling_params=SamplingParams(
        max_new_tokens=12, temperature=0.0, constraint=digits, frequency_penalty=2.0, presence_penalty=2.0))[0]
    assert re.fullmatch("[0-9]{8}", out.text) and out.finish_reason == "stop"
    # min_tokens masks EOS where the grammar could end, so the output goes on...
    longer = engine.generate(input_ids=[PROMPTS[1]], sampling_params=SamplingParams(
        max_new_tokens=12, temperature=0.0, constraint=grammars.RegexConstraint("[0-9]+"), min_tokens=6))[0]
    assert re.fullmatch("[0-9]+", longer.text) and len(longer.token_ids) >= 6
    # ...but never past the grammar's end: a finished grammar ends the output.
    short = engine.generate(input_ids=[PROMPTS[1]], sampling_params=SamplingParams(
        max_new_tokens=12, temperature=0.0, constraint=grammars.ChoiceConstraint(("7",)), min_tokens=5))[0]
    assert (short.text, short.finish_reason) == ("7", "stop")
