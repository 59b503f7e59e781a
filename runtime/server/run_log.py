"""The server's memory of recent program runs (``/programs/{name}``), for ``/ui``.

Each finished run (ok, failed, timed out, cancelled) becomes a ``RunRecord``: what ran,
when, how it ended, and the trace its program reported (``ProgramOutcome.trace``, format
``arbor.run_trace/1``) when it has one. Only the last ``max_runs`` are kept.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunRecord:
    """One program run as the server saw it."""

    run_id: str
    program: str
    arguments: dict[str, Any]
    started_at: float  # wall clock, seconds since the epoch
    latency_s: float
    status: str  # "ok" | "failed" | "timeout" | "cancelled"
    error: str | None
    trace: dict[str, Any] | None  # the program's run trace, when it reported one

    def summary(self) -> dict[str, Any]:
        """The record without the trace (the list view)."""
        totals = (self.trace or {}).get("totals", {})
        return {"run_id": self.run_id, "program": self.program, "arguments": self.arguments,
                "started_at": self.started_at, "latency_s": self.latency_s, "status": self.status,
                "error": self.error, "has_trace": self.trace is not None, "totals": totals}


class RunLog:
    """The last ``max_runs`` runs, newest first. Thread-safe."""

    def __init__(self, max_runs: int = 50) -> None:
        self._runs: deque[RunRecord] = deque(maxlen=max_runs)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def new_id(self) -> str:
        return f"run-{next(self._ids)}"

    def add(self, run_id: str, program: str, arguments: dict[str, Any], started: float,
            status: str, error: str | None = None, trace: dict[str, Any] | None = None) -> RunRecord:
        """Record a run that began at ``started`` (``time.monotonic()``) and ended now."""
        latency = time.monotonic() - started
        record = RunRecord(run_id, program, arguments, time.time() - latency, latency, status, error, trace)
        with self._lock:
            self._runs.appendleft(record)
        return record

    def recent(self) -> list[RunRecord]:
        with self._lock:
            return list(self._runs)

    def get(self, run_id: str) -> RunRecord | None:
        with self._lock:
            return next((r for r in self._runs if r.run_id == run_id), None)
