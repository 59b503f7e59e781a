"""Invariance as a contract (docs/invariance.md): on the CPU, a request's greedy and seeded
sampled tokens do not depend on what else runs or what is cached. Each scenario below
changes one axis and must give the tokens of the same request run alone on a cold cache:

- batch composition: every request submitted at once (prefills batched, decode rows shared);
- a warm prefix cache: the whole prompt but its last page served from the cache, and a
  partial hit (a prompt whose head another request of the batch computed first);
- the prefill chunk size: a prompt prefilled in 7-token chunks (off the 16-token page grid)
  beside a running decode, against one whole-prompt prefill;
- speculation off against on (prompt-lookup drafts verified in multi-row steps);
- a prefix reloaded from the disk tier (docs/kv-tier.md) instead of found in the pool;

for fp32 weights, GGUF (Q4_1) weights, and int8 KV (against itself). One thread per engine:
the thread count is outside the guarantee (a different split of a reduction rounds
differently), and a single thread keeps these tests steady on a busy machine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from runtime import Engine, SamplingParams

SYSTEM = ("<|im_start|>system\nYou are a helpful assistant. Answer every question briefly, in one "
          "short sentence, and name the country whenever you give the name of a city.<|im_end|>\n")
PROMPTS = [
    SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    # NOTE: its head is the first prompt's: batched, it waits a step and hits that prefix
    SYSTEM + "<|im_start|>user\nWhat is the capital of France? And of Italy?<|im_end|>\n<|im_start|>assistant\n",
    # repeats itself, so prompt-lookup drafts are proposed and verified
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\ndef fact(n):\n",
]
NUM_TOKENS = 12
CHUNK = 7  # chunked_prefill_size: prompts prefilled beside a decode advance 7 tokens a step


def params(speculation: bool = True) -> list[SamplingParams]:
    """Greedy, then seeded sampling, for every prompt (seeds differ between prompts)."""
    greedy = [SamplingParams(max_new_tokens=NUM_TOKENS, temperature=0, speculation=speculation)] * len(PROMPTS)
    seeded = [SamplingParams(max_new_tokens=NUM_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i,
                             speculation=speculation) for i in range(len(PROMPTS))]
    return greedy + seeded


JOBS = PROMPTS + PROMPTS  # one per params() entry


@pytest.fixture(scope="module", params=[("fp32", "auto"), ("gguf", "auto"), ("fp32", "int8")],
                ids=["fp32", "gguf", "fp32-int8kv"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    weights, kv = request.param
    # NOTE: the disk tier only holds what flush_cache(to_tier=True) puts there: nothing evicts here
    eng = Engine(model="default", weights=weights, kv_cache_dtype=kv, page_size=16, num_pages=512,
                 num_threads=1, chunked_prefill_size=CHUNK, seed=0, invariant_attention=True,
                 kv_tier_dir=str(tmp_path_factory.mktemp("tier")), kv_tier_max_bytes=2**28)
    yield eng
    eng.close()


def alone(engine: Engine, speculation: bool = True) -> list[list[int]]:
    """Each request by itself on a cold cache (flushed before each)."""
    out = []
    for prompt, p in zip(JOBS, params(speculation), strict=True):
        engine.flush_cache()
        out.append(engine.generate(prompt, p)[0].token_ids)
    return out


@pytest.fixture(scope="module")
def runs(engine: Engine) -> dict[str, Any]:
    """Each request alone on a cold cache (the reference), then at once again, warm."""
    cold, warm = [], []
    for prompt, p in zip(JOBS, params(), strict=True):
        engine.flush_cache()
        cold.append(engine.generate(prompt, p)[0])
        warm.append(engine.generate(prompt, p)[0])
    reference = [r.token_ids for r in cold]
    assert reference[:len(PROMPTS)] != reference[len(PROMPTS):]  # sampling is not greedy here
    return {"reference": reference, "cold": cold, "warm": warm}


def test_a_warm_cache_changes_nothing(runs: dict[str, Any]) -> None:
    assert all(r.num_cached_tokens == 0 for r in runs["cold"])
    assert all(r.num_cached_tokens > 0 for r in runs["warm"])  # every full page of the prompt
    assert [r.token_ids for r in runs["warm"]] == runs["reference"]


def test_batch_composition_changes_nothing(engine: Engine, runs: dict[str, Any]) -> None:
    engine.flush_cache()
    results = engine.generate(JOBS, params())
    assert [r.token_ids for r in results] == runs["reference"]
    # NOTE: held back a step for the request computing the same head: a partial hit, and a
    # whole one for the first prompt's second request
    assert results[1].num_cached_tokens > 0 and results[len(PROMPTS)].num_cached_tokens > 0


def test_chunked_prefill_beside_a_decode_changes_nothing(engine: Engine, runs: dict[str, Any]) -> None:
    """GGUF weights included: the C prefill attention kernel computes a row's bits from
    its own keys only (torch's SDPA summed them by the call's key count, and the GGUF
    kernel's int8 activations turned that into another token)."""
    with running_beside(engine):
        got = alone(engine)
    assert got == runs["reference"]


def test_speculation_changes_nothing(engine: Engine, runs: dict[str, Any]) -> None:
    assert sum(r.num_draft_tokens for r in runs["cold"]) > 0  # the reference verified drafts
    assert alone(engine, speculation=False) == runs["reference"]


def test_a_tier_reload_changes_nothing(engine: Engine, runs: dict[str, Any]) -> None:
    got = []
    for prompt, p in zip(JOBS, params(), strict=True):
        engine.flush_cache()
        engine.generate(prompt, p)
        engine.flush_cache(to_tier=True)  # the prompt's pages go to the disk tier
        assert engine.wait_tier_writes()
        out = engine.generate(prompt, p)[0]
        assert out.num_tier_cached_tokens == out.num_cached_tokens > 0  # all of it reloaded
        got.append(out.token_ids)
    assert got == runs["reference"]


class running_beside:  # noqa: N801 (a context manager used like a function)
    """A long greedy request decoding for the whole ``with`` block, so every request sent
    meanwhile shares decode steps with it and prefills in ``CHUNK``-token chunks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.started = threading.Event()
        self.request_id = ""

    def __enter__(self) -> running_beside:
        on_output: Callable[[Any], None] = lambda out: self.started.set()  # noqa: E731
        self.request_id = self.engine.add_request(
            "Tell me a very long story about a lighthouse.",
            SamplingParams(max_new_tokens=4000, temperature=0, ignore_eos=True, speculation=False),
            callback=on_output)
        assert self.started.wait(60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.abort(self.request_id)
        assert self.engine.wait_idle(60)
