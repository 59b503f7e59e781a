"""Guard rails: what the router saw of each pool over a sliding window, and the verdict of
each gate on it. Torch-free and clock-free (every call takes ``now``), so tests drive it
with a fake clock.

A gate decides only on enough samples: with fewer than its ``min_samples`` in the window
(on each side, for a ratio to the baseline) its verdict is ``wait``, never a pass or a
failure on three requests.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from runtime.router.rollout_plan import Gate

Verdict = Literal["pass", "fail", "wait"]


@dataclass(frozen=True)
class RequestSample:
    """One user request as the router saw it."""

    t: float  # clock time it ended
    ok: bool  # False: failed (a 5xx answer or the worker lost), whoever answered in the end
    ttft_s: float | None  # time to the first byte of the answer (a stream's first event)
    itl_s: float | None  # a stream's mean gap between events after the first; None: not a stream
    e2e_s: float
    constraint_valid: bool | None  # the worker's own check of a constrained output; None: none


@dataclass(frozen=True)
class ShadowSample:
    """One shadowed pair (``shadow.compare_pair``)."""

    t: float
    exact: bool | None  # identical tokens; None: not a greedy request
    kl: float | None  # mean KL over the shared positions; None: no logprobs on both sides


class Windows:
    """Per-pool request samples and the shadow samples, kept for ``horizon_s``."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self.requests: dict[str, deque[RequestSample]] = {}
        self.shadows: deque[ShadowSample] = deque()

    def add_request(self, pool: str, sample: RequestSample) -> None:
        self.requests.setdefault(pool, deque()).append(sample)

    def add_shadow(self, sample: ShadowSample) -> None:
        self.shadows.append(sample)

    def prune(self, now: float) -> None:
        for samples in self.requests.values():
            while samples and samples[0].t < now - self.horizon_s:
                samples.popleft()
        while self.shadows and self.shadows[0].t < now - self.horizon_s:
            self.shadows.popleft()

    def clear(self) -> None:
        """Forget every sample (a new step judges only its own traffic)."""
        self.requests.clear()
        self.shadows.clear()

    def since(self, pool: str, t0: float) -> list[RequestSample]:
        return [s for s in self.requests.get(pool, ()) if s.t >= t0]

    def shadows_since(self, t0: float) -> list[ShadowSample]:
        return [s for s in self.shadows if s.t >= t0]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class GateCheck:
    gate: Gate
    value: float | None  # None: not enough samples to compute it
    num_samples: int  # behind the value (the smaller side's, for a ratio)
    verdict: Verdict

    def describe(self) -> str:
        value = "n/a" if self.value is None else f"{self.value:.4g}"
        return f"{self.gate.name}: {value} over {self.num_samples} samples ({self.verdict})"


Measure = Callable[[list[RequestSample], list[RequestSample], list[ShadowSample]], tuple[float | None, int]]


def _rate(samples: list[RequestSample], bad: Callable[[RequestSample], bool | None]) -> tuple[float | None, int]:
    counted = [b for s in samples if (b := bad(s)) is not None]
    return (sum(counted) / len(counted) if counted else None), len(counted)


def _p99_ratio(field: str) -> Measure:
    def measure(base: list[RequestSample], cand: list[RequestSample], _: list[ShadowSample]) -> tuple[float | None, int]:
        b = [v for s in base if (v := getattr(s, field)) is not None]
        c = [v for s in cand if (v := getattr(s, field)) is not None]
        if not b or not c:
            return None, min(len(b), len(c))
        return percentile(c, 99) / max(percentile(b, 99), 1e-9), min(len(b), len(c))
    return measure


def _shadow_mean(field: str) -> Measure:
    def measure(_: list[RequestSample], __: list[RequestSample], shadows: list[ShadowSample]) -> tuple[float | None, int]:
        values = [float(v) for s in shadows if (v := getattr(s, field)) is not None]
        return (sum(values) / len(values) if values else None), len(values)
    return measure


MEASURES: dict[str, Measure] = {
    "error_rate": lambda base, cand, _: _rate(cand, lambda s: not s.ok),
    "ttft_p99_ratio": _p99_ratio("ttft_s"),
    "itl_p99_ratio": _p99_ratio("itl_s"),
    "e2e_p99_ratio": _p99_ratio("e2e_s"),
    "constraint_failure_rate": lambda base, cand, _: _rate(
        cand, lambda s: None if s.constraint_valid is None else not s.constraint_valid),
    "shadow_exact_match": _shadow_mean("exact"),
    "shadow_mean_kl": _shadow_mean("kl"),
}


def check_gate(gate: Gate, windows: Windows, baseline: str, candidate: str, now: float,
               since: float) -> GateCheck:
    """The gate's verdict on the samples of the last ``gate.window_s`` (none before ``since``)."""
    t0 = max(now - gate.window_s, since)
    value, n = MEASURES[gate.metric](windows.since(baseline, t0), windows.since(candidate, t0),
                                     windows.shadows_since(t0))
    if value is None or n < gate.min_samples:
        return GateCheck(gate, value, n, "wait")
    passed = value <= gate.bound if gate.side == "max" else value >= gate.bound
    return GateCheck(gate, value, n, "pass" if passed else "fail")
