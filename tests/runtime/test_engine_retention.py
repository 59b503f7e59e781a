"""Retention through the engine: a session's prefix survives other traffic in a small pool,
is released when the session ends, and bad hints are refused."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import Engine, SamplingParams
from runtime.cache.retention import Retention
from runtime.errors import InvalidRequestError

PAGE = 16


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    # 39 usable pages: room for about six 96-token conversations, not for seven
    eng = Engine(model=str(tiny_llama_dir), page_size=PAGE, num_pages=40, max_running_requests=2,
                 num_threads=1, retention_max_pages=20, retention_max_ttl_s=120.0)
    yield eng
    eng.close()


def prompt(seed: int, n: int = 96) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def run(engine: Engine, ids: list[int], retention: Retention | None = None) -> int:
    """Generate 8 tokens; return the prompt tokens the cache served."""
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, retention=retention)
    out = engine.generate(input_ids=ids, sampling_params=params)[0]
    return out.num_cached_tokens


def wait_retained(engine: Engine, pages: int) -> None:
    deadline = time.monotonic() + 10
    while engine.metrics()["kv_pages_retained"] != pages and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.metrics()["kv_pages_retained"] == pages


def pressure_then_revisit(engine: Engine, first: list[int], retention: Retention | None) -> int:
    engine.flush_cache()
    run(engine, first, retention)
    for seed in range(10, 17):  # seven other conversations: more than the pool holds
        run(engine, prompt(seed))
    return run(engine, first + prompt(99, 8))


def test_retained_session_survives_pressure_plain_lru_loses_it(engine: Engine) -> None:
    first = prompt(1)
    assert pressure_then_revisit(engine, first, None) == 0  # LRU evicted it
    hint = Retention("agent-1", ttl_s=60.0, owner="tenant-a")
    assert pressure_then_revisit(engine, first, hint) == 96  # 96 prompt + 7 computed: 6 pages
    assert engine.metrics()["kv_pages_retained"] == 6
    engine.end_session("agent-1")
    wait_retained(engine, 0)
    engine.check_integrity()


def test_ttl_above_the_cap_is_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="at most 120 s"):
        engine.add_request(input_ids=prompt(2), params=SamplingParams(retention=Retention("s", 121.0)))


@pytest.mark.parametrize("retention, message", [
    (Retention("", 10.0), "session_id"),
    (Retention("x" * 257, 10.0), "session_id"),
    (Retention("s", 0.0), "ttl_s"),
    (Retention("s", float("nan")), "ttl_s"),
    ("s", "must be a Retention"),
])
def test_malformed_hints_are_refused(retention: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(retention=retention)  # type: ignore[arg-type]


def test_pins_over_the_owner_budget_are_refused_not_failed(engine: Engine) -> None:
    engine.flush_cache()
    before = engine.metrics()["retention_pins_refused"]
    for i in range(4):  # 6 pages each; the owner may pin 20
        run(engine, prompt(40 + i), Retention(f"s{i}", 60.0, owner="greedy"))
    metrics = engine.metrics()
    assert metrics["kv_pages_retained"] == 18 and metrics["retention_pins_refused"] == before + 1
    for i in range(4):
        engine.end_session(f"s{i}")
    wait_retained(engine, 0)
    engine.check_integrity()


def test_ending_a_session_on_a_fresh_engine_leaves_it_idle(tiny_llama_dir: Path) -> None:
    """A DSL run that generated nothing still ends its session: the loop must run to drain it."""
    with Engine(model=str(tiny_llama_dir), num_pages=64, num_threads=1) as engine:
        engine.end_session("run-that-generated-nothing")
        assert engine.wait_idle(10)
    engine.end_session("after-close")  # a closed engine ignores it
