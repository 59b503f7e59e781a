"""Run one eval: both targets' scores, the comparison, the gates."""

from __future__ import annotations

from runtime.eval.replay import compare, score_target
from runtime.eval.report import EvalReport, check_gates, measures
from runtime.eval.samples import SampleSets
from runtime.eval.targets import Target


def run_eval(baseline: Target, candidate: Target, samples: SampleSets, bounds: dict[str, float]) -> EvalReport:
    """Replay ``samples`` on both targets; ``bounds``: gate name -> bound (``report.GATES``)."""
    base_scores, base_greedy = score_target(baseline, samples)
    cand_scores, cand_greedy = score_target(candidate, samples)
    comparison = compare(baseline, candidate, samples, base_greedy, cand_greedy)
    gates = check_gates(bounds, measures(base_scores, cand_scores, comparison))
    return EvalReport(baseline.label, candidate.label, getattr(baseline, "settings", {}),
                      getattr(candidate, "settings", {}), base_scores, cand_scores, comparison,
                      samples.corpus_digest, gates)
