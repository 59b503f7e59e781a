"""A program run tells its backend which run each request belongs to, and when it ends:
the engine keeps the run's states pinned while it runs and releases them at its end."""

from __future__ import annotations

import time
from typing import Any

import pytest

from frontend_dsl import ProgramError, assistant, gen, program, user
from frontend_dsl.engine_backend import EngineBackend
from frontend_dsl.fake_backend import FakeBackend


@program
def turns(s: Any) -> None:
    s += user("Name a colour. " * 8)
    forks = s.fork(2)
    for i, branch in enumerate(forks):
        branch += assistant(f"Colour {i}:" + gen("colour", max_tokens=3, temperature=0))
    forks.join()
    s += assistant(gen("more", max_tokens=3, temperature=0))


@program
def fails(s: Any) -> None:
    s += user("Hello")
    s += assistant(gen("a", max_tokens=2))
    raise RuntimeError("the body failed")


def test_every_request_names_the_run_which_ends_once(fake: FakeBackend) -> None:
    state = turns.run(fake)
    run_ids = {r.params.run_id for r in fake.requests}
    assert len(fake.requests) == 3 and len(run_ids) == 1
    assert fake.ended_runs == [state._session.executor.run_id] == list(run_ids)


def test_a_failed_run_ends_too(fake: FakeBackend) -> None:
    with pytest.raises(ProgramError):
        fails.run(fake)
    assert len(fake.ended_runs) == 1  # its request may have been cancelled before it was sent


def test_two_runs_are_two_sessions(fake: FakeBackend) -> None:
    turns.run(fake)
    turns.run(fake)
    assert len(set(fake.ended_runs)) == 2


@program
def observe(s: Any, engine: Any, seen: dict[str, float]) -> None:
    s += user("Tell me about colours. " * 4)
    s += assistant(gen("a", max_tokens=4, temperature=0))
    _ = s["a"]  # wait for it: the request finished, its state is pinned for the run
    seen["during"] = engine.metrics()["kv_pages_retained"]
    s += user("And more?")
    s += assistant(gen("b", max_tokens=4, temperature=0))


def _retained_after_end(engine: Any, before: float) -> float:
    deadline = time.monotonic() + 10
    while engine.metrics()["kv_pages_retained"] != before and time.monotonic() < deadline:
        time.sleep(0.01)
    return float(engine.metrics()["kv_pages_retained"])


def test_engine_pins_a_run_while_it_runs_and_releases_it_at_the_end(tiny_engine: Any) -> None:
    seen: dict[str, float] = {}
    before = tiny_engine.metrics()["kv_pages_retained"]  # NOTE: the engine is shared
    state = observe.run(EngineBackend(tiny_engine), engine=tiny_engine, seen=seen)
    assert seen["during"] > before
    assert _retained_after_end(tiny_engine, before) == before
    # the second turn extended the first: served from the cache
    meta = state._session.executor.streams[0].meta["b"]
    assert meta["num_cached_tokens"] >= meta["prompt_len"] - 16
    tiny_engine.check_integrity()


def test_engine_backend_without_retention_pins_nothing(tiny_engine: Any) -> None:
    seen: dict[str, float] = {}
    before = tiny_engine.metrics()["kv_pages_retained"]
    observe.run(EngineBackend(tiny_engine, retain_runs=False), engine=tiny_engine, seen=seen)
    assert seen["during"] == before
