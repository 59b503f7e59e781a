"""The eval's result: both targets' scores side by side, the comparison, and the gates.

A gate is a bound set on the command line (``--min-agreement 0.97``); a report whose
gate fails makes ``arbor eval`` exit non-zero, so CI and a canary can use it.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TargetScores:
    """What one target scored on its own."""

    perplexity: float
    extraction_exact: float  # share of extraction samples parsed to exactly the expected object
    constrained_valid: float  # share of constrained outputs that parse and satisfy the schema
    qa_exact: float
    single_stream_tok_s: float
    batch_tok_s: float

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


@dataclass(frozen=True)
class Comparison:
    """The candidate against the baseline, position by position."""

    top1_agreement: float
    mean_kl: float
    kl_method: str  # "exact" or "top-20"
    num_positions: int
    greedy_match: float  # share of prompts with identical greedy tokens
    greedy_prefix: float  # mean share of greedy tokens before the first difference


# gate name -> (the measure it bounds, "min" or "max", what the bound means)
GATES: dict[str, tuple[str, str, str]] = {
    "min_agreement": ("top1_agreement", "min", "next-token top-1 agreement with the baseline"),
    "max_kl": ("mean_kl", "max", "mean KL(baseline || candidate), nats"),
    "min_greedy_match": ("greedy_match", "min", "share of prompts with identical greedy tokens"),
    "max_ppl_ratio": ("ppl_ratio", "max", "candidate perplexity / baseline perplexity"),
    "max_exact_drop": ("exact_drop", "max", "largest drop in extraction or QA exact match"),
    "min_valid": ("constrained_valid", "min", "candidate's share of valid constrained outputs"),
}
ROWS = (  # (label, TargetScores field, format)
    ("perplexity (stdlib docstrings)", "perplexity", "{:.3f}"),
    ("JSON extraction exact match", "extraction_exact", "{:.1%}"),
    ("constrained output validity", "constrained_valid", "{:.1%}"),
    ("few-shot QA exact match", "qa_exact", "{:.1%}"),
    ("decode tok/s, one stream", "single_stream_tok_s", "{:.1f}"),
    ("decode tok/s, all prompts", "batch_tok_s", "{:.1f}"),
)


@dataclass(frozen=True)
class GateResult:
    name: str  # the flag's name, e.g. "min_agreement"
    bound: float
    value: float
    passed: bool


@dataclass(frozen=True)
class EvalReport:
    baseline: str
    candidate: str
    baseline_settings: dict[str, Any]
    candidate_settings: dict[str, Any]
    baseline_scores: TargetScores
    candidate_scores: TargetScores
    comparison: Comparison
    corpus_digest: str  # reports compare only with equal digests (see samples.py)
    gates: list[GateResult]

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        data["python"] = platform.python_version()
        return data

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2, default=str) + "\n")

    def table(self) -> str:
        """Side by side, then the comparison and the gates, as plain text."""
        width = max(len(self.baseline), len(self.candidate), 12)
        lines = [f"{'':34} {self.baseline:>{width}} {self.candidate:>{width}}"]
        for label, name, fmt in ROWS:
            b, c = getattr(self.baseline_scores, name), getattr(self.candidate_scores, name)
            lines.append(f"{label:34} {fmt.format(b):>{width}} {fmt.format(c):>{width}}")
        cmp = self.comparison
        lines += [
            "",
            f"next-token top-1 agreement   {cmp.top1_agreement:.2%} over {cmp.num_positions} positions",
            f"mean KL(baseline||candidate) {cmp.mean_kl:.5f} nats ({cmp.kl_method})",
            f"greedy outputs identical     {cmp.greedy_match:.0%} of prompts "
            f"({cmp.greedy_prefix:.0%} of tokens before the first difference)",
            f"corpus digest                {self.corpus_digest}",
        ]
        for g in self.gates:
            lines.append(f"gate {g.name} {g.bound:g}: {g.value:.4g} {'PASS' if g.passed else 'FAIL'}")
        return "\n".join(lines)


def measures(base: TargetScores, cand: TargetScores, cmp: Comparison) -> dict[str, float]:
    """The values the gates bound."""
    return {
        "top1_agreement": cmp.top1_agreement,
        "mean_kl": cmp.mean_kl,
        "greedy_match": cmp.greedy_match,
        "ppl_ratio": cand.perplexity / base.perplexity,
        "exact_drop": max(base.extraction_exact - cand.extraction_exact, base.qa_exact - cand.qa_exact),
        "constrained_valid": cand.constrained_valid,
    }


def check_gates(bounds: dict[str, float], values: dict[str, float]) -> list[GateResult]:
    """One result per bound given (``bounds``: gate name -> bound)."""
    results = []
    for name, bound in bounds.items():
        measure, side, _ = GATES[name]
        value = values[measure]
        results.append(GateResult(name, bound, value, value >= bound if side == "min" else value <= bound))
    return results
