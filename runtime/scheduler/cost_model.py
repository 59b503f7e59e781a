"""What a step costs: an online model of step time from the rows a step computes.

A step's time is modelled per *regime*, because one engine runs two kinds of step whose
costs differ in kind, not degree: a step that only decodes (one row per request; on the
CPU with block-quantized weights it is one native call) and a step with multi-token rows
(prefill chunks, speculative verification), which takes the layer-by-layer path::

    decode-only:  t = c0 + c_decode * decode_rows
    extend:       t = c0 + c_decode * decode_rows + c_prefill * prefill_tokens
                     + c_verify * verify_rows

Each regime is a weighted least-squares fit over the steps the engine ran, with
exponential forgetting (the machine's load changes; recent steps count most) and a small
ridge prior: toward zero, and, for the extend regime, tying ``c_verify`` to
``c_prefill`` (a verify row is an extend row; the tie only matters until verify rows
have been seen). A regime with fewer than ``min_observations`` steps predicts None:
callers then fall back to their own prior.

Torch-free: the scheduler (prefill budgets) and the speculation gate (draft or not) both
read it; the engine core feeds it the time of every step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

Regime = Literal["decode", "extend"]

# Forgetting per observed step of a regime: the fit weighs the last ~1 / (1 - DECAY)
# steps, a few seconds of serving, so it follows load changes on a shared machine.
DECAY = 0.98
# A step slower than this many times its prediction (a GC pause, a preempted core) is
# fitted as if it took that long, so one stall does not teach the model a slow machine.
OUTLIER_FACTOR = 3.0
_RIDGE = 1e-9  # keeps the normal equations solvable before every feature has varied
_TIE = 1.0  # weight of c_verify == c_prefill, in rows squared (about one observation)


@dataclass(frozen=True)
class StepShape:
    """The rows of one step, as far as its cost goes."""

    decode_rows: int = 0  # one-token rows (decoding requests without drafts)
    prefill_tokens: int = 0  # tokens of prefill chunks
    verify_rows: int = 0  # rows of verify items: the newest token plus its drafts, each

    @property
    def regime(self) -> Regime:
        return "decode" if self.prefill_tokens == 0 and self.verify_rows == 0 else "extend"

    @property
    def empty(self) -> bool:
        return self.decode_rows + self.prefill_tokens + self.verify_rows == 0

    def features(self) -> tuple[float, ...]:
        if self.regime == "decode":
            return (1.0, float(self.decode_rows))
        return (1.0, float(self.decode_rows), float(self.prefill_tokens), float(self.verify_rows))


class _OnlineFit:
    """Exponentially weighted ridge least squares over a fixed feature vector."""

    def __init__(self, num_features: int, tie: tuple[int, int] | None) -> None:
        n = num_features
        self.xtx = [[0.0] * n for _ in range(n)]  # sum of w * x x^T
        self.xty = [0.0] * n  # sum of w * x y
        self.num_observations = 0
        self.coef = [0.0] * n
        self._prior = [[_RIDGE if i == j else 0.0 for j in range(n)] for i in range(n)]
        if tie is not None:  # penalty _TIE * (coef[a] - coef[b])^2
            a, b = tie
            self._prior[a][a] += _TIE
            self._prior[b][b] += _TIE
            self._prior[a][b] -= _TIE
            self._prior[b][a] -= _TIE

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(c * v for c, v in zip(self.coef, x, strict=True))

    def observe(self, x: tuple[float, ...], y: float) -> None:
        cap = OUTLIER_FACTOR * self.predict(x) if self.num_observations >= 2 else 0.0
        if cap > 0:
            y = min(y, cap)
        n = len(x)
        for i in range(n):
            self.xty[i] = DECAY * self.xty[i] + x[i] * y
            for j in range(n):
                self.xtx[i][j] = DECAY * self.xtx[i][j] + x[i] * x[j]
        self.num_observations += 1
        a = [[self.xtx[i][j] + self._prior[i][j] for j in range(n)] for i in range(n)]
        self.coef = _solve(a, list(self.xty))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` by Gaussian elimination with partial pivoting (a is small and, with the
    ridge prior, positive definite)."""
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


class StepCostModel:
    """Step time in seconds from a ``StepShape``, learnt from the steps the engine runs.

    Args:
        min_observations: steps a regime needs before it predicts (None before that).

    Thread-safe: the engine thread observes; other threads may read predictions.
    """

    def __init__(self, min_observations: int = 3) -> None:
        self.min_observations = min_observations
        self._fits: dict[Regime, _OnlineFit] = {"decode": _OnlineFit(2, None), "extend": _OnlineFit(4, (2, 3))}
        self._lock = threading.Lock()

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record that a step of ``shape`` took ``seconds``."""
        if shape.empty or not seconds > 0:
            return
        with self._lock:
            self._fits[shape.regime].observe(shape.features(), seconds)

    def predict(self, shape: StepShape) -> float | None:
        """Predicted seconds of a step of ``shape``; None while its regime has too few
        observations. Never below zero."""
        with self._lock:
            fit = self._fits[shape.regime]
            if fit.num_observations < self.min_observations:
                return None
            return max(fit.predict(shape.features()), 0.0)

    def num_observations(self, regime: Regime) -> int:
        return self._fits[regime].num_observations
