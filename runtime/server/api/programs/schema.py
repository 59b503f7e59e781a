"""The program endpoints' wire shapes (``routes.py``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ProgramInfo(BaseModel):
    name: str
    description: str
    arguments_schema: dict[str, Any]


class ProgramsResponse(BaseModel):
    programs: list[ProgramInfo]


class ProgramResult(BaseModel):
    program: str
    variables: dict[str, Any]
    text: str
    latency: float
    run_id: str | None = None  # the run's entry in /ui/api/runs
    trace: dict[str, Any] | None = None  # the run's trace (format arbor.run_trace/1), when asked for
