"""Self-consistency: sample 8 answers from forks of one prompt and take the majority.

The 8 branches share the question's tokens, so the engine computes that prefix once
(see the cache hit rate printed at the end).

    python examples/self_consistency.py
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import default_engine  # noqa: E402

from frontend_dsl import assistant, gen, program, user  # noqa: E402
from frontend_dsl.default_backend import as_backend  # noqa: E402


@program
def sample_answers(s: Any, question: str, n: int = 8, max_tokens: int = 24) -> None:
    s += user(question + " Think briefly, then end with 'Answer: <number>'.")
    forks = s.fork(n)
    for i, branch in enumerate(forks):
        branch += assistant(gen("reasoning", max_tokens=max_tokens, temperature=0.8, seed=i))
    forks.join()


def final_number(text: str) -> str | None:
    """The number after 'Answer:', else the last number in ``text``."""
    tagged = re.search(r"Answer:\s*(-?\d+)", text)
    numbers = re.findall(r"-?\d+", text)
    return tagged.group(1) if tagged else (numbers[-1] if numbers else None)


def majority(answers: list[str | None]) -> tuple[str | None, Counter[str]]:
    """The most common non-empty answer (first seen wins ties) and all counts."""
    votes = Counter(a for a in answers if a is not None)
    return (votes.most_common(1)[0][0] if votes else None), votes


def main(engine: Any = None, question: str = "What is 12 + 30?", n: int = 8, max_tokens: int = 24) -> str | None:
    """Print every sample, the vote and the cache hit rate; return the majority answer."""
    backend = as_backend(default_engine(engine))
    state = sample_answers.run(backend, question=question, n=n, max_tokens=max_tokens)
    answers = [final_number(text) for text in state["reasoning"]]
    for i, (text, answer) in enumerate(zip(state["reasoning"], answers, strict=True)):
        print(f"[{i}] {answer!s:>6}  {text.strip()[:70]!r}")
    winner, votes = majority(answers)
    print(f"votes: {dict(votes)} -> majority answer: {winner}")
    print(f"engine cache hit rate: {backend.metrics().get('cache_hit_rate', 0.0):.2f}")
    return winner


if __name__ == "__main__":
    main()
