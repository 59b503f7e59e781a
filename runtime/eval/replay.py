"""Replay the sample sets on a baseline and a candidate and measure what changed.

Every measure is the mean over a fixed set, so two reports of the same sets compare:

- ``top1_agreement``: share of next-token positions (teacher-forced on ``prompts``) where
  the candidate's most likely token is the baseline's;
- ``mean_kl``: KL(baseline || candidate) in nats, per position, over the same positions
  (exact where both expose whole distributions, else over the baseline's top 20);
- ``greedy_match``: share of ``prompts`` whose 32 greedy tokens are identical, and the
  mean share of tokens before the first difference;
- per target: perplexity of ``corpus``, exact match of ``extraction`` and ``qa``, validity
  of the constrained (JSON schema) outputs, decode speed (one stream, and all prompts;
  medians of runs taken in turns).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from runtime.eval.compare import greedy_match as compare_greedy
from runtime.eval.compare import mean_topk_kl
from runtime.eval.report import Comparison
from runtime.eval.samples import SampleSets, extraction_message, qa_prompt
from runtime.eval.targets import Generation, GenParams, PositionDists, Target

MAX_CORPUS_TOKENS = 256  # per docstring: enough context, a short eval
GREEDY_TOKENS = 32
SPEED_STREAMS = 4  # prompts decoded one at a time for the single-stream figure


def _log(message: str) -> None:
    print(f"[eval] {message}", file=sys.stderr, flush=True)


def mean_kl(base: PositionDists, cand: PositionDists) -> tuple[float, str]:
    """Mean KL(base || cand) per position, and how it was computed.

    With whole distributions on both sides it is exact. Otherwise it is the sum over the
    baseline's top-k tokens of p (log p - log q), where a token outside the candidate's
    top-k gets the candidate's k-th logprob (an upper bound of its own): the mass outside
    the baseline's top-k is left out.
    """
    if base.full is not None and cand.full is not None:
        p = base.full.exp()
        kl = (p * (base.full - cand.full)).sum(-1)
        return float(kl.clamp(min=0).mean()), "exact"
    if cand.full is not None:  # NOTE: the candidate's whole distribution: no floor needed
        log_q = cand.full.gather(1, base.top_ids)
        kl = (base.top_logprobs.exp() * (base.top_logprobs - log_q)).sum(-1)
        return float(kl.clamp(min=0).mean()), f"top-{base.top_ids.shape[1]}"
    return mean_topk_kl(_tops(base), _tops(cand)), f"top-{base.top_ids.shape[1]}"


def _tops(dists: PositionDists) -> list[dict[int, float]]:
    """Each position's top-k as {token id: logprob} (the form ``compare.topk_kl`` takes)."""
    return [dict(zip(ids, lps, strict=True)) for ids, lps in zip(dists.top_ids.tolist(),
                                                                 dists.top_logprobs.tolist(), strict=True)]


def compare(baseline: Target, candidate: Target, samples: SampleSets, base_greedy: list[Generation],
            cand_greedy: list[Generation]) -> Comparison:
    """Top-1 agreement and KL over every position of the prompt set, and the match of the
    two targets' greedy outputs (``speed``'s batch outputs)."""
    agree, kls, positions = 0, [], 0
    method = "exact"
    for text in samples.prompts:
        ids = baseline.encode(text)
        if len(ids) < 2:
            continue
        base, cand = baseline.position_dists(ids), candidate.position_dists(ids)
        agree += int((base.top_ids[:, 0] == cand.top_ids[:, 0]).sum())
        kl, method = mean_kl(base, cand)
        kls.append(kl * len(ids[1:]))
        positions += len(ids) - 1
    match, prefix = greedy_match(base_greedy, cand_greedy)
    return Comparison(agree / max(positions, 1), sum(kls) / max(positions, 1), method, positions, match, prefix)


def greedy_match(base: list[Generation], cand: list[Generation]) -> tuple[float, float]:
    """(share of identical outputs, mean share of tokens before the first difference)."""
    return compare_greedy([(b.token_ids, c.token_ids) for b, c in zip(base, cand, strict=True)])


def perplexity(target: Target, corpus: list[str]) -> float:
    """exp of the mean negative log-likelihood over every scored corpus token."""
    total, count = 0.0, 0
    for doc in corpus:
        ids = target.encode(doc)[:MAX_CORPUS_TOKENS]
        if len(ids) >= 2:
            lps = target.token_logprobs(ids)
            total -= sum(lps)
            count += len(lps)
    return math.exp(total / max(count, 1))


def extraction_scores(target: Target, samples: SampleSets) -> tuple[float, float]:
    """(exact match, schema validity) of the constrained extraction outputs."""
    import jsonschema

    exact = valid = 0
    for sample in samples.extraction:
        ids = target.encode(target.chat_prompt(extraction_message(sample)))
        out = target.generate([ids], GenParams(max_new_tokens=64, json_schema=sample.schema))[0]
        try:
            value = json.loads(out.text)
            jsonschema.validate(value, sample.schema)
        except (ValueError, jsonschema.ValidationError):
            continue
        valid += 1
        exact += int(value == sample.expected)
    n = max(len(samples.extraction), 1)
    return exact / n, valid / n


def qa_exact(target: Target, samples: SampleSets) -> float:
    prompts = [target.encode(qa_prompt(s.question)) for s in samples.qa]
    outs = target.generate(prompts, GenParams(max_new_tokens=8, stop=("\n",)))
    hits = sum(o.text.strip().lower() == s.answer.lower() for o, s in zip(outs, samples.qa, strict=True))
    return hits / max(len(samples.qa), 1)


def speed(target: Target, prompts: list[list[int]]) -> tuple[float, float, list[Generation]]:
    """(single-stream tok/s, all-prompts-together tok/s, the batch's greedy outputs)."""
    params = GenParams(max_new_tokens=GREEDY_TOKENS, ignore_eos=True)
    target.generate(prompts[:1], GenParams(max_new_tokens=4))  # warm-up
    start = time.perf_counter()
    singles = [target.generate([ids], params)[0] for ids in prompts[:SPEED_STREAMS]]
    single = sum(len(o.token_ids) for o in singles) / (time.perf_counter() - start)
    start = time.perf_counter()
    outs = target.generate(prompts, params)
    batch = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    return single, batch, outs


def quality(target: Target, samples: SampleSets) -> tuple[float, float, float, float]:
    """(perplexity, extraction exact match, constrained validity, QA exact match)."""
    timed: Callable[[str, Callable[[], Any]], Any] = _timed
    ppl = timed(f"{target.label}: perplexity", lambda: perplexity(target, samples.corpus))
    ext, valid = timed(f"{target.label}: extraction", lambda: extraction_scores(target, samples))
    qa = timed(f"{target.label}: few-shot QA", lambda: qa_exact(target, samples))
    return ppl, ext, valid, qa


def speeds(targets: list[Target], samples: SampleSets, repeats: int) -> list[tuple[float, float, list[Generation]]]:
    """Each target's median (single-stream, batch) tok/s over ``repeats`` runs, taken in
    turns (A B A B ...) so drift in the machine's load hits both alike, and its greedy
    outputs (the same every run: greedy)."""
    prompts = [[t.encode(p) for p in samples.prompts] for t in targets]
    runs: list[list[tuple[float, float, list[Generation]]]] = [[] for _ in targets]
    for _ in range(repeats):
        for target, ids, done in zip(targets, prompts, runs, strict=True):
            start = time.perf_counter()
            done.append(speed(target, ids))
            _log(f"{target.label}: speed ({time.perf_counter() - start:.1f} s)")
    return [(statistics.median(r[0] for r in done), statistics.median(r[1] for r in done), done[-1][2])
            for done in runs]


def _timed(what: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = fn()
    _log(f"{what} ({time.perf_counter() - start:.1f} s)")
    return result
