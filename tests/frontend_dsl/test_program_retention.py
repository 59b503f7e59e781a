"""A program run tells its backend which run each request belongs to, and when it ends:
the engine keeps the run's states pinned while it runs and releases them at its end."""

from __future__ import annotations

import time
from typing import Any

import pytest

from frontend_dsl import ProgramError, assistant, gen, program, select, user
from frontend_dsl.engine_backend import EngineBackend
from frontend_dsl.fake_backend import FakeBackend
from frontend_dsl.runtime_endpoint import RuntimeEndpoint


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


@program
def choose(s: Any, engine: Any, seen: dict[str, float]) -> None:
    s += user("Pick a colour for the wall. " * 4)
    s += assistant(select("colour", choices=["red", "green", "blue"]))
    _ = s["colour"]  # its scoring requests finished: pinned for the run
    seen["during"] = engine.metrics().get("kv_pages_retained", 0.0)


def test_select_scoring_names_the_run(fake: FakeBackend) -> None:
    state = choose.run(fake, engine=fake, seen={})
    run_id = state._session.executor.run_id
    assert fake.scored_runs and set(fake.scored_runs) == {run_id}


def test_engine_pins_a_select_like_a_gen(tiny_engine: Any) -> None:
    seen: dict[str, float] = {}
    before = tiny_engine.metrics()["kv_pages_retained"]
    choose.run(EngineBackend(tiny_engine), engine=tiny_engine, seen=seen)
    assert seen["during"] > before
    assert _retained_after_end(tiny_engine, before) == before


def test_runtime_endpoint_pins_a_run_on_the_server_and_ends_it(endpoint: Any, tiny_engine: Any) -> None:
    seen: dict[str, float] = {}
    before = tiny_engine.metrics()["kv_pages_retained"]
    observe.run(endpoint, engine=tiny_engine, seen=seen)
    assert seen["during"] > before
    # NOTE: end_run's DELETE /sessions/{id} returns once the pins are gone: no wait needed
    assert tiny_engine.metrics()["kv_pages_retained"] == before
    assert not [s for s in tiny_engine.cache.retention.sessions if s.startswith("anonymous/run-")]


def test_runtime_endpoint_without_retention_pins_nothing(endpoint: Any, tiny_engine: Any) -> None:
    seen: dict[str, float] = {}
    before = tiny_engine.metrics()["kv_pages_retained"]
    plain = RuntimeEndpoint(endpoint.client.base_url, retention_ttl_s=None)
    try:
        observe.run(plain, engine=tiny_engine, seen=seen)
    finally:
        plain.client.close()
    assert seen["during"] == before
