"""Seeded sampling that nothing else can change: a seeded request's tokens are a function
of (model, prompt, parameters, seed) alone — alone or in a batch of 16, with speculation on
or off, in a roomy pool or one small enough to force retraction (tiny random Llama, CPU)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from grammars import RegexConstraint
from runtime import Engine, SamplingParams
from tests.runtime.speculative.drafting import always_draft

NUM_REQUESTS = 16


# Grammar-forced spans ("The answer is ", ", because ") are drafted and verified; the
# sampled parts between them draw from the Gumbel noise of their own positions.
ANSWER = RegexConstraint(r"The answer is (yes|no|maybe), because [a-z ]{1,30}\.")


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """16 prompts (repetitive, so prompt lookup drafts too) with sampled, seeded
    parameters; every other request is constrained."""
    rng = random.Random(1)
    prompts, params = [], []
    for i in range(NUM_REQUESTS):
        motif = [rng.randrange(3, 49152) for _ in range(rng.randint(2, 4))]
        prompts.append([1, *motif * rng.randint(3, 6), rng.randrange(3, 49152)])
        params.append(SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95 if i % 2 else 1.0,
                                     top_k=0 if i % 3 else 50, seed=1000 + i, ignore_eos=True,
                                     constraint=ANSWER if i % 2 == 0 else None))
    return prompts, params


def engine(model_dir: Path, **settings: object) -> Engine:
    # NOTE: every lookup draft is verified (paying or not), so the speculative runs
    # really verify drafts at batch 16 too.
    return always_draft(Engine(model=str(model_dir), page_size=4, num_threads=1, **settings))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def alone(tiny_llama_dir: Path) -> list[list[int]]:
    """Each request on its own, speculation off, in a roomy pool without a prefix cache."""
    prompts, params = workload()
    with engine(tiny_llama_dir, num_pages=1024, speculation=False, disable_prefix_cache=True) as e:
        return [e.generate(input_ids=p, sampling_params=sp)[0].token_ids
                for p, sp in zip(prompts, params, strict=True)]


@pytest.mark.parametrize("speculation", [False, True])
def test_seeded_tokens_alone_equal_batched(tiny_llama_dir: Path, alone: list[list[int]],
                                           speculation: bool) -> None:
    prompts, params = workload()
    assert len({tuple(t) for t in alone}) == NUM_REQUESTS
    with engine(tiny_llama_dir, num_pages=1024, speculation=speculation) as e:
        assert [o.token_ids for o in e.generate(input_ids=prompts, sampling_params=params)] == alone
        if speculation:
            assert e.metrics()["spec_accepted_tokens"] > 0, "no draft was ever accepted"


def test_seeded_tokens_survive_retraction_with_speculation(tiny_llama_dir: Path,
                                                          alone: list[list[int]]) -> None:
    prompts, params = workload()
    # 16 requests of up to ~45 tokens need ~190 pages of 4; 60 pages force retraction.
    with engine(tiny_llama_dir, num_pages=60, decode_reserve_tokens=0, speculation=True,
                debug=True) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params)
        metrics = e.metrics()
    assert metrics["num_retractions"] > 0 and metrics["spec_accepted_tokens"] > 0
    assert [o.token_ids for o in outs] == alone


def test_a_different_seed_gives_different_tokens(tiny_llama_dir: Path, alone: list[list[int]]) -> None:
    prompts, params = workload()
    other = SamplingParams(max_new_tokens=24, temperature=1.0, seed=params[0].seed + 1,  # type: ignore[operator]
                           ignore_eos=True, top_k=params[0].top_k, top_p=params[0].top_p)
    with engine(tiny_llama_dir, num_pages=1024) as e:
        assert e.generate(input_ids=prompts[0], sampling_params=other)[0].token_ids != alone[0]
