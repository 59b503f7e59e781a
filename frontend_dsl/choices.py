"""How ``select`` decides: the scoring methods over the choices' token logprobs.

Every choice is scored on the tokens it adds to the state, over the same span (see
``score_spans``). A method turns the per-choice token logprobs into one score each (or,
for a user's callable, into a decision); ``temperature > 0`` samples from
``softmax(score / temperature)`` instead of taking the best.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from typing import Any

from frontend_dsl.backend import Backend
from frontend_dsl.errors import GenerationError
from frontend_dsl.primitives import Select
from frontend_dsl.tokens import plan_append


async def decide(backend: Backend, ids: list[int], spec: Select,
                 run_id: str | None = None) -> tuple[int, dict[str, Any]]:
    """The index of the chosen choice and the select's meta (scores, token logprobs...);
    ``run_id``: the program run asking (its scoring requests are kept for it)."""
    spans, start = score_spans(ids, spec.choices, backend)
    logprobs = list(await asyncio.gather(*(backend.score(full, start, run_id=run_id) for full in spans)))
    unconditional = None
    if spec.needs_unconditional:
        unconditional = list(await asyncio.gather(*(_unconditional(backend, full[start:]) for full in spans)))
    meta: dict[str, Any] = {"method": spec.method_name,
                            "token_logprobs": dict(zip(spec.choices, logprobs, strict=True))}
    if unconditional is not None:
        meta["unconditional_token_logprobs"] = dict(zip(spec.choices, unconditional, strict=True))
    if not isinstance(spec.method, str):
        return _user_decision(spec, logprobs, unconditional), meta
    scores = method_scores(spec.method, logprobs, unconditional)
    meta["scores"] = dict(zip(spec.choices, scores, strict=True))
    if spec.temperature > 0:
        return _sample(scores, spec.temperature, spec.seed), meta
    return _argmax_first(scores, logprobs, spec.method), meta


def score_spans(ids: list[int], choices: Sequence[str], backend: Backend) -> tuple[list[list[int]], int]:
    """Each choice appended to ``ids``, and the first position every choice is scored
    from: the earliest position any choice re-tokenizes (see ``tokens.py``), so a choice
    that merges with the state's last token is compared fairly with one that does not.
    Position 0 has no logprob."""
    plans = [plan_append(ids, c, backend) for c in choices]
    start = max(1, min(keep for keep, _ in plans))
    return [ids[:keep] + new for keep, new in plans], start


def method_scores(method: str, logprobs: list[list[float]],
                  unconditional: list[list[float]] | None) -> list[float]:
    """One score per choice under a named method (higher is better)."""
    if method == "token_length_normalized":
        return [sum(lp) / max(1, len(lp)) for lp in logprobs]
    if method == "unnormalized":
        return [float(sum(lp)) for lp in logprobs]
    if method == "greedy_token_selection":
        return [lp[0] if lp else 0.0 for lp in logprobs]
    assert method == "unconditional_likelihood_normalized" and unconditional is not None
    return [sum(c - u for c, u in zip(lp, un, strict=True)) / max(1, len(lp))
            for lp, un in zip(logprobs, unconditional, strict=True)]


async def _unconditional(backend: Backend, span: list[int]) -> list[float]:
    """The logprobs of ``span`` with no context before it; its first token has none, so
    it counts 0 (its conditional logprob is compared as it is)."""
    rest = await backend.score(span, 1) if len(span) > 1 else []
    return [0.0, *rest]


def _argmax_first(scores: list[float], logprobs: list[list[float]], method: str) -> int:
    if method != "greedy_token_selection":
        return max(range(len(scores)), key=lambda i: (scores[i], -i))
    # Greedy: compare token by token, a shorter choice padded with its mean logprob;
    # the first position that separates the remaining choices decides.
    width = max(len(lp) for lp in logprobs)
    rows = [lp + [sum(lp) / len(lp) if lp else 0.0] * (width - len(lp)) for lp in logprobs]
    remaining = list(range(len(rows)))
    for j in range(width):
        best = max(rows[i][j] for i in remaining)
        remaining = [i for i in remaining if rows[i][j] == best]
        if len(remaining) == 1:
            break
    return remaining[0]


def _sample(scores: list[float], temperature: float, seed: int | None) -> int:
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    return random.Random(seed).choices(range(len(scores)), weights=weights)[0]


def _user_decision(spec: Select, logprobs: list[list[float]], unconditional: list[list[float]] | None) -> int:
    decision = spec.method(choices=list(spec.choices), token_logprobs=logprobs,  # type: ignore[operator]
                           unconditional_token_logprobs=unconditional)
    if isinstance(decision, bool) or not isinstance(decision, int | str):
        raise GenerationError(f"select method {spec.method_name} returned {decision!r}, "
                              f"not a choice or its index")
    if isinstance(decision, str):
        if decision not in spec.choices:
            raise GenerationError(f"select method {spec.method_name} chose {decision!r}, not one of the choices")
        return spec.choices.index(decision)
    if not 0 <= decision < len(spec.choices):
        raise GenerationError(f"select method {spec.method_name} returned index {decision} "
                              f"for {len(spec.choices)} choices")
    return decision
