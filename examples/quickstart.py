"""Quickstart: one question, one answer, then a batch of questions.

    python examples/quickstart.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import default_engine  # noqa: E402

from frontend_dsl import assistant, gen, program, set_default_backend, system, user  # noqa: E402


@program
def qa(s: Any, question: str, max_tokens: int = 32) -> None:
    s += system("You are a helpful assistant. Answer in one short sentence.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=max_tokens, temperature=0, stop="\n"))


QUESTIONS = ["What is the capital of France?", "What is 2 + 2?", "Name a primary colour."]


def main(engine: Any = None, max_tokens: int = 32) -> list[str]:
    """Answer QUESTIONS (the first one alone, then all as a batch); return the answers."""
    set_default_backend(default_engine(engine))
    state = qa.run(question=QUESTIONS[0], max_tokens=max_tokens)
    print(f"Q: {QUESTIONS[0]}\nA: {state['answer']}\n")
    states = qa.run_batch([{"question": q, "max_tokens": max_tokens} for q in QUESTIONS], progress=True)
    answers = [s["answer"] for s in states]
    for question, answer in zip(QUESTIONS, answers, strict=True):
        print(f"Q: {question}\nA: {answer}")
    return answers


if __name__ == "__main__":
    main()
