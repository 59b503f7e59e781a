"""Speculative decoding: faster, never different.

Greedy outputs with speculation on equal outputs with it off, token for token; with
sampling the distribution is kept (chi-square on a tiny model with a 16-token vocab).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

from grammars import RegexConstraint, load_grammar
from runtime import Engine, SamplingParams
from runtime.sampling.sampler import sample
from runtime.speculative.drafts import PromptLookupDraft
from runtime.speculative.verify import verify_drafts
from tests.runtime.speculative.drafting import always_draft


class Person(BaseModel):
    name: str
    age: int
    city: str


DOC = ("Maria Garcia is a 35 year old architect who lives in Barcelona. She designs "
       "public libraries and has worked at Studio Norte since 2015.")


def _chat(engine: Engine, text: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.slow
def test_greedy_never_different_on_default_model(default_engine: Engine) -> None:
    cases = [
        (f"Extract the person from: {DOC}\nAnswer as JSON.", Person, 64),
        ("Give the year Maria joined Studio Norte: " + DOC, RegexConstraint(r"[0-9]{4}"), 8),
        ("Write an arithmetic expression with three numbers.", load_grammar("arithmetic"), 24),
        ("Repeat this sentence twice: " + DOC, None, 64),
    ]
    prompts = [_chat(default_engine, text) for text, _, _ in cases]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, constraint=c, speculation=False)
              for _, c, n in cases]
    off = default_engine.generate(prompts, params)
    before = default_engine.metrics()
    on = default_engine.generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0.0, constraint=c)
                                           for _, c, n in cases])
    after = default_engine.metrics()
    for a, b in zip(off, on, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"], "speculation never kicked in"
    default_engine.wait_idle()
    default_engine.check_integrity()


@pytest.fixture(scope="module")
def tiny16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose vocabulary has 16 tokens (chi-square needs few categories)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import _save_tiny_model

    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return _save_tiny_model(config, LlamaForCausalLM, tmp_path_factory.mktemp("tiny16"))


def _sampled_tokens(engine: Engine, seeds: range) -> torch.Tensor:
    """[len(seeds), 10] tokens of seeded sampled requests, 8 at a time."""
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]  # repetitive, so prompt lookup proposes drafts
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in seeds]
    outs = [o for i in range(0, len(params), 8)
            for o in engine.generate(input_ids=[prompt] * len(params[i : i + 8]), sampling_params=params[i : i + 8])]
    return torch.tensor([o.token_ids for o in outs])


@pytest.mark.slow
def test_sampling_distribution_kept(tiny16_dir: Path) -> None:
    """Seeded sampled tokens are the same with speculation on and off (a draft is accepted
    exactly when it is the token the sampler draws at that seed and position); and on seeds
    the plain run never saw, speculation's samples follow plain sampling's distribution
    (two independent samples, so the chi-square test can fail)."""
    from scipy.stats import chi2_contingency

    runs = 600
    tokens = {}
    for spec in (False, True):
        engine = Engine(model=str(tiny16_dir), page_size=4, num_pages=2048, speculation=spec)
        try:
            tokens[spec] = _sampled_tokens(always_draft(engine), range(runs))
            if spec:
                fresh = _sampled_tokens(engine, range(runs, 2 * runs))
                assert engine.metrics()["spec_draft_tokens"] > 0
                assert engine.metrics()["spec_accepted_tokens"] > 0
        finally:
            engine.close()
    assert torch.equal(tokens[False], tokens[True])
    hist = {name: torch.stack([torch.bincount(t[:, i], minlength=16) for i in range(10)])
            for name, t in (("plain", tokens[False]), ("speculative", fresh))}
    for pos in (1, 4, 9):  # positions past the first draft
        table = torch.stack([hist["plain"][pos], hist["speculative"][pos]])
        table = table[:, table.sum(0) > 0]
        p_value = chi2_contingency(table.numpy())[1]
        assert p_value > 0.001, f"position {pos}: distributions differ (p={p_value:.2g})"


@pytest.mark.slow
def test_verify_rule_keeps_the_distribution() -> None:
    """The first returned token is distributed as p whatever the draft is, and it is the
    token plain sampling draws at that (seed, position)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(2, 1)
    params = SamplingParams(temperature=1.0)
    for draft in (0, 3):
        counts = torch.zeros(4)
        for seed in range(4000):
            tokens, accepted = verify_drafts(logits.clone(), [draft], params, None, seed, 7, set())
            counts[tokens[0]] += 1
            assert tokens[0] == sample(logits[:1], [params], [seed], [7]).token_ids[0]
            assert accepted == (tokens[0] == draft)
        assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_verify_greedy_accepts_exact_prefix() -> None:
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 5, 1, 7]):
        logits[row, best] = 5.0
    tokens, accepted = verify_drafts(logits, [3, 5, 2], SamplingParams(temperature=0.0), None,
                                     0, 0, set())
    assert tokens == [3, 5, 1] and accepted == 2
    tokens, accepted = verify_drafts(logits, [3, 5, 1], SamplingParams(temperature=0.0), None,
                                     0, 0, set())
    assert tokens == [3, 5, 1, 7] and accepted == 3  # all accepted plus one bonus token


def test_prompt_lookup_copies_what_followed() -> None:
    draft = PromptLookupDraft(max_ngram=3, min_ngram=2)
    ids = [9, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3]
    assert draft.propose(ids, None, 3) == [4, 5, 6]
    assert draft.propose([1, 2, 3, 4], None, 3) == []


def test_speculation_can_be_disabled(tiny_llama_dir: Path) -> None:
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=512, speculation=False)
    try:
        engine.generate(input_ids=[[5, 6, 7, 5, 6, 7, 5, 6]], sampling_params=SamplingParams(
            max_new_tokens=16, temperature=0.0, ignore_eos=True))
        assert engine.metrics()["spec_draft_tokens"] == 0
        assert engine.metrics()["forward_passes"] == 16
    finally:
        engine.close()


def test_text_lookup_finds_copies_that_token_ngrams_miss(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    from runtime.speculative.drafts import TextLookupDraft

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    draft = TextLookupDraft(tok)
    prompt = "Profile: Maria Elena Garcia joined Northwind in 2016."
    ids = draft.propose(prompt, '{"name": "Maria Elena', 4)
    assert tok.decode(ids).startswith(" Garcia")
    assert draft.propose(prompt, '{"name": "Zed', 4) == []


@pytest.mark.parametrize(("temperature", "penalties"), [
    (0.0, {"frequency_penalty": -1.0, "presence_penalty": 0.5}),
    (1.0, {"frequency_penalty": -1.0, "presence_penalty": 0.5}),
    (0.0, {"repetition_penalty": 1.3}),
])
def test_speculation_never_changes_penalized_tokens(tiny16_dir: Path, temperature: float,
                                                   penalties: dict[str, float]) -> None:
    """Row i of a verify pass is penalized as if the drafts before it were appended, so
    drafts are accepted exactly when plain decoding picks them. (Penalties that favour
    repeats, so that drafts are accepted here; the processor's tests show the row-by-row
    adjustment with a draft rejected because of an earlier one.)"""
    prompt = [3, 4, 5, 6] * 4  # repetitive, so prompt lookup proposes drafts
    params = [SamplingParams(max_new_tokens=24, temperature=temperature, seed=s, ignore_eos=True, **penalties)
              for s in range(8)]
    tokens = {}
    for spec in (False, True):
        eng = Engine(model=str(tiny16_dir), page_size=4, num_pages=1024, speculation=spec)
        try:
            tokens[spec] = [o.token_ids for o in always_draft(eng).generate(input_ids=[prompt] * 8, sampling_params=params)]
            if spec:
                assert eng.metrics()["spec_draft_tokens"] > 0 and eng.metrics()["spec_accepted_tokens"] > 0
        finally:
            eng.close()
    assert tokens[False] == tokens[True]
