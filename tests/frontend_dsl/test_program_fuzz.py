"""Hypothesis on the DSL: random programs of text, gen (plain and constrained), select,
fork/join (nested), tool calls (that succeed, raise or are slow), reads of generated
values and bodies that raise. On the fake backend and on the tiny model: every run ends
(no hang), either with a state or a ``ProgramError`` whose cause is one of the typed
errors the program could meet, and on the engine nothing stays queued or holds KV pages.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend_dsl import (
    GenerationError,
    ProgramError,
    ProgramLimitError,
    ProgramState,
    gen,
    program,
    select,
    tool,
)
from frontend_dsl.fake_backend import FakeRequest

RUN_TIMEOUT_S = 20.0


class BodyError(Exception):
    """What a random program's body raises on purpose."""


@tool
def flaky(mode: str) -> str:
    """Echo ``mode``; raise for "raise", sleep a little for "slow"."""
    if mode == "raise":
        raise RuntimeError("the tool failed")
    if mode == "slow":
        time.sleep(0.05)
    return mode


WORDS = st.sampled_from(["alpha", "beta", "gamma", " delta", "x", "?"])
GEN_KINDS = st.sampled_from(["plain", "regex", "choices", "json"])
LEAF_STEPS = st.one_of(
    st.tuples(st.just("text"), WORDS),
    st.tuples(st.just("gen"), st.integers(1, 6), GEN_KINDS),
    st.tuples(st.just("select"), st.lists(WORDS, min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("tool"), st.sampled_from(["ok", "raise", "slow"])),
    st.tuples(st.just("read")),
    st.tuples(st.just("raise")),
)


def _with_forks(steps: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    fork = st.tuples(st.just("fork"), st.integers(1, 3), st.lists(steps, max_size=3),
                     st.sampled_from(["gather", "concat", None]))
    return st.one_of(steps, fork)


STEPS = st.lists(st.recursive(LEAF_STEPS, _with_forks, max_leaves=8), min_size=1, max_size=6)


def run_steps(s: ProgramState, steps: list[Any], names: Any) -> None:
    last: str | None = None
    for step in steps:
        kind = step[0]
        if kind == "text":
            s += step[1]
        elif kind == "gen":
            last = f"v{next(names)}"
            s += gen(last, **_gen_args(step[1], step[2]))
        elif kind == "select":
            last = f"v{next(names)}"
            s += select(last, step[1])
        elif kind == "tool":
            last = f"v{next(names)}"
            s += f"Call flaky with mode {step[1]}:"
            s += gen(last, tools=[flaky], max_tokens=24)
        elif kind == "read" and last is not None:
            s += f" [{str(s[last])[:10]}]"
        elif kind == "raise":
            raise BodyError("the body raised")
        elif kind == "fork":
            branches = s.fork(step[1])
            for b in branches:
                run_steps(b, step[2], names)
            if step[3] is not None:
                branches.join(step[3])


def _gen_args(max_tokens: int, kind: str) -> dict[str, Any]:
    if kind == "regex":
        return {"max_tokens": max_tokens, "regex": "[ab]{1,3}"}
    if kind == "choices":
        return {"choices": ["yes", "no"]}  # a select: max_tokens would be refused
    if kind == "json":
        return {"max_tokens": max_tokens, "json_schema": {"type": "object", "properties": {
            "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}
    return {"max_tokens": max_tokens, "temperature": 0}


@program(max_branches=40)
def random_program(s, steps: list[Any]):
    s += "Start."
    run_steps(s, steps, itertools.count())


def fake_responder(request: FakeRequest) -> str:
    """An answer that satisfies the request's constraint (when it fits max_tokens)."""
    c = request.params.constraint
    if c is None:
        return " ok" * request.params.max_tokens
    if c.kind == "regex":
        return "ab"
    if c.kind == "choices":
        return "yes"
    schema = c.json_value()
    if "anyOf" in schema or "name" in schema.get("properties", {}):
        mode = "raise" if "raise" in request.prompt[-40:] else "ok"
        return json.dumps({"name": "flaky", "arguments": {"mode": mode}})
    return '{"a":1}'


def run_bounded(backend: Any, steps: list[Any]) -> BaseException | None:
    """Run in a worker thread; fail if it has not ended within RUN_TIMEOUT_S."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(random_program.run, backend, steps=steps)
    try:
        future.result(timeout=RUN_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"the program did not end within {RUN_TIMEOUT_S} s: {steps!r}")
    except ProgramError as exc:
        return exc
    finally:
        pool.shutdown(wait=False)  # NOTE: a hung run must not hang the test too
    return None


def check_outcome(error: BaseException | None, steps: list[Any]) -> None:
    if error is None:
        return
    cause = error.__cause__
    assert isinstance(cause, BodyError | GenerationError | ProgramLimitError), (
        f"{type(cause).__name__}: {cause} for {steps!r}")
    assert isinstance(error.state.text(), str)  # the partial state stays readable


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=STEPS)
def test_random_programs_on_the_fake_backend(make_fake: Any, steps: list[Any]) -> None:
    check_outcome(run_bounded(make_fake(fake_responder), steps), steps)


@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=STEPS)
def test_random_programs_on_the_tiny_model_leave_nothing_behind(tiny_engine: Any, steps: list[Any]) -> None:
    check_outcome(run_bounded(tiny_engine, steps), steps)
    assert tiny_engine.wait_idle(30), "requests left queued or running after the run"
    tiny_engine.check_integrity()
    assert tiny_engine.metrics()["kv_pages_used"] == 0, "KV pages held after the run"
