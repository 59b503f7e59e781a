"""Per-run bounds: branches forked and tool calls; past one, the run fails typed, before
the excess starts."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from frontend_dsl import ProgramDefinitionError, ProgramError, ProgramLimitError, gen, program, tool


@tool
def ping(n: int) -> int:
    """Return n + 1."""
    return n + 1


@program(max_branches=6)
def wide(s, n: int, depth: int = 1):
    s += "Q:"
    branches = s.fork(n)
    if depth > 1:
        for b in branches:
            b.fork(n)
    for b in branches:
        b += gen("x", max_tokens=2)


@program(max_tool_calls=3)
def agent(s, rounds: int):
    s += "Go."
    for i in range(rounds):
        s += gen(f"call{i}", tools=[ping], max_tokens=40)


def test_forks_within_the_bound_run(make_fake: Callable[..., Any]) -> None:
    state = wide.run(make_fake(), n=6)
    assert state.text().startswith("Q:")


def test_forks_past_the_bound_fail_typed_before_generating(make_fake: Callable[..., Any]) -> None:
    backend = make_fake()
    with pytest.raises(ProgramError) as err:
        wide.run(backend, n=3, depth=2)  # 3 + 3 nested: 6 ok; then 9 > 6
    assert isinstance(err.value.__cause__, ProgramLimitError)
    assert "would fork 9 branches; the limit is 6" in str(err.value.__cause__)
    with pytest.raises(ProgramError):
        wide.run(backend, n=7)
    assert isinstance(ProgramLimitError("x"), ProgramDefinitionError)


def test_tool_calls_past_the_bound_fail_typed(make_fake: Callable[..., Any]) -> None:
    backend = make_fake(lambda r: json.dumps({"name": "ping", "arguments": {"n": 1}}))
    state = agent.run(backend, rounds=3)
    assert state["call2"].result == 2
    with pytest.raises(ProgramError) as err:
        agent.run(backend, rounds=4)
    assert "more than 3 tool calls" in str(err.value.__cause__)
    assert len(backend.requests) <= 6  # the fourth call of the second run never started


def test_limits_are_validated() -> None:
    with pytest.raises(ProgramDefinitionError, match="max_branches"):
        program(max_branches=0)(lambda s: None)
