"""Whether speculation pays: acceptance per request and draft source, against measured cost.

A verify item of ``k`` drafts replaces its request's one decode row by ``1 + k`` rows and
yields ``1 + E(k)`` tokens, where ``E(k)`` is the expected number of accepted drafts. The
gate chooses, each step, the drafts that maximize the step's tokens per second::

    J = (B + sum over chosen of E_i(k_i)) / T(step with those verify rows)

``B``: decoding requests; ``T``: the step cost model (``runtime.scheduler.cost_model``),
learnt from the steps the engine ran, so a verify pass that leaves a fast decode-only
path (one native call on the CPU) is charged what it really costs. Until both the
decode-only and the extend regime are measured, ``T`` falls back to a row count with a
fixed cost of ``fixed_cost_rows`` rows a pass; while only the decode-only regime is
unmeasured, lookup drafts wait (the cheap regime is measured first, in a few steps).

Acceptance: draft positions are accepted in order, each with a request's and source's
conditional rate ``q`` (``SourceStats``), so ``E(k) = q + q^2 + .. + q^k``. ``q`` is
learnt from the rounds verified and from *shadow* rounds: drafts the gate declined are
compared with the tokens the request then produces. Decoding is exact (a draft is
accepted iff plain decoding produces it), so a shadow round's acceptance is the one a
verify pass would have had, at no cost: text that stops echoing its prompt stops
drafting, and text that starts echoing starts again, without blind re-probing.

Grammar-forced drafts are always verified: the grammar admits nothing else there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.scheduler.cost_model import StepCostModel, StepShape

# A chosen set of drafts must raise the step's predicted tokens per second by this much:
# below it the gain is within the cost model's error on a shared machine (its one-step
# predictions are off by a third at the median there: tests/runtime/scheduler), and a
# wrong "yes" costs a whole verify pass while a wrong "no" costs only the gain.
MIN_GAIN = 0.25


@dataclass
class SourceStats:
    """Acceptance of one draft source for one request (verified and shadow rounds)."""

    accepted: int = 0  # draft tokens accepted (or that would have been, in shadow rounds)
    rejections: int = 0  # rounds that ended at a rejected draft

    @property
    def acceptance(self) -> float:
        """Conditional acceptance of the next draft position, with a Laplace prior (one
        accepted, one rejected): the geometric model's estimate."""
        return (self.accepted + 1) / (self.accepted + self.rejections + 2)

    def expected_accepted(self, num_drafts: int) -> float:
        """E(k) = q + q^2 + .. + q^k."""
        q = self.acceptance
        return q * (1 - q**num_drafts) / (1 - q)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.accepted += num_accepted
        self.rejections += num_accepted < num_drafts


@dataclass
class Shadow:
    """Drafts the gate declined, checked against what the request produces next."""

    source: str
    draft_ids: tuple[int, ...]
    start: int  # output position the first draft guessed (len(output_ids) when proposed)

    def resolve(self, output_ids: Sequence[int]) -> tuple[int, int] | None:
        """(num_drafts, num_accepted) once known (a mismatch, or every draft matched);
        None while the output has not got that far."""
        produced = output_ids[self.start : self.start + len(self.draft_ids)]
        for i, token in enumerate(produced):
            if token != self.draft_ids[i]:
                return len(self.draft_ids), i
        return (len(self.draft_ids), len(produced)) if len(produced) == len(self.draft_ids) else None


# Shadow rounds whose first draft missed, in a row, before lookup proposals back off:
# a request then skips 2, 4, .. up to MAX_BACKOFF_STEPS steps of proposing (proposing
# costs a text search and a tokenization per step, a few percent of a one-stream decode
# step on the CPU), until a round accepts something again.
MAX_BACKOFF_STEPS = 16


@dataclass
class RequestSpeculation:
    """A request's speculation state, kept by the output processor."""

    sources: dict[str, SourceStats] = field(default_factory=dict)
    shadow: Shadow | None = None
    num_misses: int = 0  # rounds in a row (shadow or verified) that accepted nothing
    skip_steps: int = 0  # steps left without lookup proposals (backoff)

    def stats(self, source: str) -> SourceStats:
        return self.sources.setdefault(source, SourceStats())

    def check_shadow(self, output_ids: Sequence[int]) -> None:
        """Count the pending shadow round once its outcome is known."""
        if self.shadow is not None and (outcome := self.shadow.resolve(output_ids)) is not None:
            self.record(self.shadow.source, *outcome)
            self.shadow = None

    def record(self, source: str, num_drafts: int, num_accepted: int) -> None:
        """A round's outcome, verified or shadow."""
        self.stats(source).record(num_drafts, num_accepted)
        self.num_misses = 0 if num_accepted else self.num_misses + 1
        if self.num_misses >= 2:
            self.skip_steps = min(2 ** (self.num_misses - 1), MAX_BACKOFF_STEPS)

    def may_propose(self) -> bool:
        """Whether lookup drafts are proposed this step (counts a backoff step down)."""
        if self.skip_steps > 0:
            self.skip_steps -= 1
            return False
        return True


@dataclass(frozen=True)
class Candidate:
    """Drafts proposed for one decoding request."""

    request_id: str
    num_drafts: int
    stats: SourceStats | None  # None: grammar-forced (always verified)


class SpeculationGate:
    """Chooses which proposed drafts to verify this step (see the module docstring).

    Args:
        cost: the engine's step cost model.
        fixed_cost_rows: the prior: a pass costs this many rows plus one per row.
    """

    def __init__(self, cost: StepCostModel, fixed_cost_rows: float) -> None:
        self.cost, self.fixed_cost_rows = cost, fixed_cost_rows

    def choose(self, num_decoding: int, candidates: Sequence[Candidate]) -> dict[str, int]:
        """Draft tokens to verify per request id (a prefix of its proposal); requests left
        out decode one token."""
        chosen = {c.request_id: c.num_drafts for c in candidates if c.stats is None}
        gain = float(sum(chosen.values()))  # forced drafts: (almost) always accepted
        best = self._rate(num_decoding, chosen, gain)
        if best is None:
            return chosen
        # NOTE: most promising requests first; each takes the draft length that raises
        # the step's rate most, given the drafts chosen before it.
        for c in sorted(candidates, key=lambda c: -c.stats.acceptance if c.stats else 0.0):
            pick = self._best_length(num_decoding, chosen, gain, c)
            if pick is not None and pick[0] > best * (1 + MIN_GAIN):
                best, chosen[c.request_id], gain = pick[0], pick[1], gain + pick[2]
        return chosen

    def _best_length(self, num_decoding: int, chosen: dict[str, int], gain: float,
                     c: Candidate) -> tuple[float, int, float] | None:
        """(rate, k, E(k)) of the draft length that gives the step its best rate."""
        if c.stats is None:
            return None
        best: tuple[float, int, float] | None = None
        for k in range(1, c.num_drafts + 1):
            e = c.stats.expected_accepted(k)
            rate = self._rate(num_decoding, {**chosen, c.request_id: k}, gain + e)
            if rate is not None and (best is None or rate > best[0]):
                best = (rate, k, e)
        return best

    def worth_proposing(self, num_decoding: int, max_drafts: int) -> bool:
        """Whether a lookup draft could pay at all this step (every draft accepted): when
        not, proposing (and shadowing) is skipped."""
        base = self._rate(num_decoding, {}, 0.0)
        rate = self._rate(num_decoding, {"": max_drafts}, float(max_drafts))
        return base is not None and rate is not None and rate > base * (1 + MIN_GAIN)

    def _rate(self, num_decoding: int, chosen: dict[str, int], gain: float) -> float | None:
        """Predicted tokens per second of the step; None when lookup drafts must wait."""
        shape = StepShape(decode_rows=num_decoding - len(chosen),
                          verify_rows=sum(1 + k for k in chosen.values()))
        seconds = self._seconds(shape)
        if seconds is None:
            return None
        return (num_decoding + gain) / max(seconds, 1e-9)

    def _seconds(self, shape: StepShape) -> float | None:
        decode = self.cost.predict(StepShape(decode_rows=max(shape.decode_rows, 1)))
        extend = self.cost.predict(StepShape(verify_rows=1))
        if decode is None and extend is not None:
            return None  # measure the decode-only regime first
        if decode is None or extend is None:
            return self.fixed_cost_rows + shape.decode_rows + shape.verify_rows
        return self.cost.predict(shape)
