"""How many prompt tokens one step may prefill while other requests decode.

Prefill sets time to first token (TTFT); every prefill token in a step also delays the
tokens of the streams decoding in it (inter-token latency, ITL). Two policies:

- ``FixedBudget``: a small fixed chunk while anything decodes, the large budget otherwise
  (``chunked_prefill_size`` / ``max_prefill_tokens``): the baseline.
- ``LatencyTargetBudget``: sized each step from latency targets and the step cost model
  (``cost_model.py``)::

      nothing decodes          -> the large budget
      ITL tokens  = the most prefill tokens whose step the cost model predicts within the
                    tightest ITL target of the decoding streams (none: the min chunk)
      ITL target  = a request's own, else the engine's in seconds, else the engine's in
                    decode steps: that many times the predicted decode-only step of one
                    stream, and at least two decode-only steps of the current batch (the
                    default: a pace relative to the model's own carries across models
                    and machines; the floor keeps a full batch's target reachable)
      TTFT tokens = for the prompts waiting (oldest first), the tokens per step that finish
                    each one before its TTFT target, counting the prompts ahead of it
      budget      = max(ITL tokens, TTFT tokens), within [min chunk, large budget],
                    and with an ITL target, TTFT tokens only up to a step predicted
                    within ``itl_stretch`` x that target

  So prompts go in big chunks while no stream's ITL is at risk, in small ones when it
  is, and a prompt about to miss its TTFT target gets the tokens it needs at the cost of
  a slower step, one at most ``itl_stretch`` times the ITL target: a prompt that is late
  already would otherwise take the whole queue's tokens in one step, a stall of every
  running stream (the ITL tail of a large model, where that step takes seconds). The floor (the fixed chunk) keeps prefill moving when a target
  cannot be met, and before the cost model has measured anything. Without any target
  (engine or request) it budgets exactly as ``FixedBudget``.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from runtime.config import EngineConfig
from runtime.request import Request
from runtime.scheduler.cost_model import StepCostModel, StepShape

log = logging.getLogger("arbor.scheduler")

# The floor of a target in decode steps, in decode-only steps of the current batch: a
# step that prefills anything beside the batch costs more than the batch alone.
MIN_BATCH_STEPS = 2.0


class PrefillBudget(ABC):
    @abstractmethod
    def tokens(self, decoding: Sequence[Request], prefilling: Sequence[Request]) -> int:
        """Prefill tokens for this step (at least 1).

        Args:
            decoding: the requests decoding this step whose latency counts.
            prefilling: requests with prompt tokens left to compute (waiting, or part-way
                prefilled), in any order.
        """


class FixedBudget(PrefillBudget):
    """``chunk`` tokens while anything decodes, ``max_tokens`` otherwise."""

    def __init__(self, chunk: int, max_tokens: int) -> None:
        self.chunk, self.max_tokens = chunk, max_tokens

    def tokens(self, decoding: Sequence[Request], prefilling: Sequence[Request]) -> int:
        return self.chunk if decoding else self.max_tokens


class LatencyTargetBudget(PrefillBudget):
    """Prefill budgets from ITL and TTFT targets (see the module docstring).

    Args:
        cost: the engine's step cost model.
        itl_slo, ttft_slo: the engine's targets in seconds (None: none); a request's own
            (``SamplingParams.itl_slo`` / ``ttft_slo``) wins over them.
        min_chunk, max_tokens: the budget's floor and ceiling.
        itl_stretch: the longest step the TTFT rule may ask for, in multiples of the
            tightest ITL target of the decoding streams (no ITL target: no limit).
        itl_steps: the engine's ITL target in decode-only steps of one stream (None: none),
            used when ``itl_slo`` is None; at least ``MIN_BATCH_STEPS`` decode-only steps
            of the current batch.
        clock: seconds (``time.monotonic``; tests pass a virtual clock).
    """

    def __init__(self, cost: StepCostModel, itl_slo: float | None, ttft_slo: float | None,
                 min_chunk: int, max_tokens: int, clock: Callable[[], float] = time.monotonic,
                 itl_stretch: float = 2.0, itl_steps: float | None = None) -> None:
        self.cost, self.itl_slo, self.ttft_slo = cost, itl_slo, ttft_slo
        self.itl_steps = itl_steps
        self.min_chunk, self.max_tokens, self.clock = min_chunk, max_tokens, clock
        self.itl_stretch = itl_stretch
        self._warned = False

    def tokens(self, decoding: Sequence[Request], prefilling: Sequence[Request]) -> int:
        if not decoding:
            return self.max_tokens
        target = self._itl_target(decoding)
        itl = self._itl_tokens(len(decoding), target)
        ttft = self._ttft_tokens(len(decoding), prefilling)
        if ttft > itl and target is not None and self._step(len(decoding), self.min_chunk) is not None:
            ttft = min(ttft, self._largest_within(len(decoding), self.itl_stretch * target))
        return max(self.min_chunk, min(self.max_tokens, max(itl, ttft)))

    def _itl_target(self, decoding: Sequence[Request]) -> float | None:
        engine = self.itl_slo if self.itl_slo is not None else self._relative_itl_target(len(decoding))
        targets = [t for r in decoding if (t := r.params.itl_slo or engine) is not None]
        return min(targets) if targets else None

    def _relative_itl_target(self, num_decoding: int) -> float | None:
        """``itl_steps`` decode-only steps of one stream, at least ``MIN_BATCH_STEPS`` of
        this batch, in seconds (None: no relative target, or decode steps not measured yet).

        NOTE: one stream's step, not the batch's: a target that grew with the batch would
        let every running stream's ITL grow with the load (measured: docs/serving-slo.md).
        """
        if self.itl_steps is None:
            return None
        one = self.cost.predict(StepShape(decode_rows=1))
        batch = self.cost.predict(StepShape(decode_rows=num_decoding))
        if one is None or batch is None:
            return None
        return max(self.itl_steps * one, MIN_BATCH_STEPS * batch)

    def _itl_tokens(self, rows: int, target: float | None) -> int:
        if target is None:
            return self.min_chunk  # no ITL target: the fixed chunk, as FixedBudget
        if self._step(rows, self.min_chunk) is None:
            return self.min_chunk  # unmeasured: the fixed chunk
        if not self._fits(rows, self.min_chunk, target):
            self._warn_unreachable(target, rows)
            return self.min_chunk
        return self._largest_within(rows, target)

    def _largest_within(self, rows: int, seconds: float) -> int:
        """The most prefill tokens (at least the min chunk) of a step predicted within ``seconds``."""
        lo, hi = self.min_chunk, self.max_tokens  # NOTE: lo is the floor, whether or not it fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._fits(rows, mid, seconds) else (lo, mid - 1)
        return lo

    def _ttft_tokens(self, num_decoding: int, prefilling: Sequence[Request]) -> int:
        """Tokens per step that finish every waiting prompt within its TTFT target."""
        step = self._step(num_decoding, self.min_chunk)
        now, ahead, wanted = self.clock(), 0, 0
        for r in sorted(prefilling, key=lambda r: r.arrival_s):
            ahead += r.num_remaining  # NOTE: prompts that arrived earlier go first
            target = r.params.ttft_slo or self.ttft_slo
            if target is None or step is None:
                continue
            slack = target - (now - r.arrival_s)
            steps = max(1, math.floor(slack / max(step, 1e-9)))  # late (slack <= 0): one step
            wanted = max(wanted, math.ceil(ahead / steps))
        return wanted

    def _step(self, num_decoding: int, prefill_tokens: int) -> float | None:
        return self.cost.predict(StepShape(decode_rows=num_decoding, prefill_tokens=prefill_tokens))

    def _fits(self, num_decoding: int, prefill_tokens: int, target: float) -> bool:
        seconds = self._step(num_decoding, prefill_tokens)
        return seconds is not None and seconds <= target

    def _warn_unreachable(self, target: float, rows: int) -> None:
        if not self._warned:
            self._warned = True
            log.warning("ITL target %.3f s is below the measured step time with %d streams decoding "
                        "(%.3f s with a %d-token prefill chunk): prefilling in %d-token chunks", target,
                        rows, self._step(rows, self.min_chunk) or 0.0, self.min_chunk, self.min_chunk)


def prefill_budget(config: EngineConfig, cost: StepCostModel) -> PrefillBudget:
    """The engine's budget policy: latency targets (the engine's, in seconds or in decode
    steps, or a request's own)."""
    assert config.chunked_prefill_size is not None  # filled in by for_device
    return LatencyTargetBudget(cost, config.itl_slo, config.ttft_slo, config.chunked_prefill_size,
                               config.max_prefill_tokens, itl_stretch=config.itl_stretch,
                               itl_steps=config.itl_slo_steps)
