"""Programs the soak (``benchmarks/soak.py``) registers with its server: forks, and tool
calls that succeed, raise or run past the request's deadline."""

from __future__ import annotations

import time
from typing import Any

from frontend_dsl import gen, program, tool

FACTS = {"paris": "capital of France", "rome": "capital of Italy"}


@tool
def lookup(key: str) -> str:
    """A fact by key; raises KeyError for an unknown key."""
    return FACTS[key.lower()]


@tool
def wait(seconds: float) -> str:
    """Sleep (at most 3 s), then answer: slow enough to pass a short deadline."""
    time.sleep(max(0.0, min(float(seconds), 3.0)))
    return "waited"


@program(max_branches=8)
def vote(s: Any, question: str, n: int = 3) -> None:
    """``n`` greedy branches answer, then the parent gathers them (variable ``answer``)."""
    s += "Question: " + question + "\nAnswer:"
    branches = s.fork(n)
    for b in branches:
        b += gen("answer", max_tokens=8, temperature=0.7)
    branches.join()


@program(max_tool_calls=4)
def agent(s: Any, task: str, rounds: int = 2) -> None:
    """Up to ``rounds`` tool calls (lookup may raise; wait may outlast the deadline)."""
    s += "Task: " + task + "\n"
    for i in range(rounds):
        s += gen(f"call{i}", tools=[lookup, wait], max_tokens=32)
        s += "\n"
