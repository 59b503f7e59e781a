"""Helpers shared by the benchmarks: timing, medians, reproduce lines, JSON results."""

from __future__ import annotations

import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def reproduce_line() -> str:
    return "reproduce: " + " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def time_call(fn: Any, repeats: int) -> float:
    """Median seconds of one ``fn()`` call, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()
    except OSError:
        return "n/a"


def save_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"machine": platform.platform(), "loadavg": load_average(), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
