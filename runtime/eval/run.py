"""Run one eval: both targets' scores, the comparison, the gates."""

from __future__ import annotations

from runtime.eval.replay import compare, quality, speeds
from runtime.eval.report import EvalReport, TargetScores, check_gates, measures
from runtime.eval.samples import SampleSets
from runtime.eval.targets import Target


def run_eval(baseline: Target, candidate: Target, samples: SampleSets, bounds: dict[str, float],
             speed_repeats: int = 3) -> EvalReport:
    """Replay ``samples`` on both targets; ``bounds``: gate name -> bound (``report.GATES``)."""
    base_quality, cand_quality = quality(baseline, samples), quality(candidate, samples)
    (base_single, base_batch, base_greedy), (cand_single, cand_batch, cand_greedy) = speeds(
        [baseline, candidate], samples, speed_repeats)
    base_scores = TargetScores(*base_quality, base_single, base_batch)
    cand_scores = TargetScores(*cand_quality, cand_single, cand_batch)
    comparison = compare(baseline, candidate, samples, base_greedy, cand_greedy)
    gates = check_gates(bounds, measures(base_scores, cand_scores, comparison))
    return EvalReport(baseline.label, candidate.label, getattr(baseline, "settings", {}),
                      getattr(candidate, "settings", {}), base_scores, cand_scores, comparison,
                      samples.corpus_digest, gates)
