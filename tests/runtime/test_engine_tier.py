"""The KV tier through the engine: pages evicted under pressure come back from the disk
tier instead of being recomputed, with the same greedy tokens; namespaces stay apart; a
corrupt page is recomputed; the bookkeeping checks hold."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import Engine, SamplingParams
from runtime.cache.kv_tier import NoTier
from runtime.model.disk_tier import DiskTier
from runtime.output.request_output import RequestOutput

PAGE = 16


@pytest.fixture(scope="module", params=["auto", "int8"], ids=["fp32-kv", "int8-kv"])
def engine(request: pytest.FixtureRequest, tiny_llama_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    # 39 usable pages: one 200-token prompt and its output hold 13; three others evict it
    eng = Engine(model=str(tiny_llama_dir), page_size=PAGE, num_pages=40, max_running_requests=2,
                 num_threads=1, kv_cache_dtype=request.param, debug=True,
                 kv_tier_dir=str(tmp_path_factory.mktemp("tier")), kv_tier_max_bytes=2**24)
    assert isinstance(eng.tier, DiskTier)
    yield eng
    eng.close()


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def run(engine: Engine, ids: list[int], tenant: str | None = None) -> RequestOutput:
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    return asyncio.run(engine.agenerate(input_ids=ids, sampling_params=params, tenant=tenant))


def settle(engine: Engine) -> None:
    assert engine.wait_tier_writes()


def test_pages_evicted_under_pressure_are_reloaded_with_the_same_tokens(engine: Engine) -> None:
    engine.flush_cache()
    first = prompt(1)
    cold = run(engine, first)
    for seed in range(10, 13):  # other traffic evicts the first prompt's pages
        run(engine, prompt(seed))
    settle(engine)
    again = run(engine, first + prompt(99, 8))
    assert cold.num_cached_tokens == 0
    assert again.num_tier_cached_tokens > 0  # reloaded, not recomputed
    assert again.num_cached_tokens == again.num_tier_cached_tokens  # none of it was left in the pool
    same = run(engine, first)  # now a pool hit
    assert same.token_ids == cold.token_ids and same.num_tier_cached_tokens == 0
    engine.flush_cache(to_tier=True)
    settle(engine)
    reloaded = run(engine, first)
    assert reloaded.num_tier_cached_tokens == 192 and reloaded.num_cached_tokens == 192  # whole pages, last one computed
    assert reloaded.token_ids == cold.token_ids
    metrics = engine.metrics()
    assert metrics["tier_cached_prompt_tokens"] >= 192 + again.num_tier_cached_tokens
    assert metrics["kv_tier_pages"] > 0 and metrics["kv_tier_corrupt_pages"] == 0
    engine.check_integrity()


def test_a_flush_empties_the_tier_too(engine: Engine) -> None:
    ids = prompt(2)
    run(engine, ids)
    engine.flush_cache(to_tier=True)
    settle(engine)
    engine.flush_cache()
    assert engine.tier.num_pages == 0
    assert run(engine, ids).num_cached_tokens == 0


def test_another_tenant_never_reloads_a_tenants_pages(engine: Engine) -> None:
    engine.flush_cache()
    ids = prompt(3)
    run(engine, ids, tenant="a")
    engine.flush_cache(to_tier=True)
    settle(engine)
    assert run(engine, ids, tenant="b").num_cached_tokens == 0
    assert run(engine, ids, tenant="a").num_tier_cached_tokens == 192


def test_a_corrupt_page_is_recomputed_with_the_same_tokens(engine: Engine) -> None:
    engine.flush_cache()
    ids = prompt(4)
    cold = run(engine, ids)
    engine.flush_cache(to_tier=True)
    settle(engine)
    tier = engine.tier
    assert isinstance(tier, DiskTier)
    match = tier.match(ids, None, 0)
    tier._slots[match.slots[5], 7] ^= 0x40  # one bit of the sixth page, on "disk"
    got = run(engine, ids)
    assert got.num_tier_cached_tokens == 5 * PAGE  # the pages before it
    assert got.token_ids == cold.token_ids
    assert engine.metrics()["kv_tier_corrupt_pages"] == 1
    engine.check_integrity()


def test_an_unusable_tier_directory_serves_without_a_tier(tiny_llama_dir: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="arbor.kv_tier"):
        eng = Engine(model=str(tiny_llama_dir), page_size=PAGE, num_pages=40, num_threads=1,
                     kv_tier_dir=str(blocker / "tier"))
    try:
        assert isinstance(eng.tier, NoTier)
        assert "KV tier disabled" in caplog.text
        assert len(run(eng, prompt(5)).token_ids) == 8
    finally:
        eng.close()
