"""Bounds on one program run, so a program (or the arguments a client sends it) cannot
grow without end: branches forked and tool calls. Past a bound the run fails with
``ProgramLimitError`` before the excess is started (over HTTP: a 422)."""

from __future__ import annotations

from dataclasses import dataclass

from frontend_dsl.errors import ProgramDefinitionError


@dataclass(frozen=True)
class ProgramLimits:
    """Per-run bounds; give them with ``@program(max_branches=..., max_tool_calls=...)``."""

    max_branches: int = 1024  # branches forked over one run, all forks (and nested ones) together
    max_tool_calls: int = 64  # gen(..., tools=...) calls over one run (an agent loop's rounds)

    def __post_init__(self) -> None:
        for name in ("max_branches", "max_tool_calls"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ProgramDefinitionError(f"{name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = ProgramLimits()
