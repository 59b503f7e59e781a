"""Programs registered with the server (``PROGRAMS``): name -> ``Program``.

Each takes only JSON-able arguments and leaves its results in named variables.

    python examples/programs.py     # runs each once on the default model
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pydantic

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import default_engine  # noqa: E402

from frontend_dsl import Program, assistant, gen, program, select, system, user  # noqa: E402


class Contact(pydantic.BaseModel):
    name: str
    email: str


@program
def qa(s: Any, question: str, max_tokens: int = 32) -> None:
    """Answer a question: variable ``answer``."""
    s += user(question)
    s += assistant(gen("answer", max_tokens=max_tokens, temperature=0))


@program
def sentiment(s: Any, text: str) -> None:
    """Classify text: variable ``label`` in positive / negative / neutral."""
    s += system("Classify the sentiment of the user's text.")
    s += user(text)
    s += assistant(select("label", ["positive", "negative", "neutral"]))


@program
def extract_contact(s: Any, text: str, max_tokens: int = 48) -> None:
    """Extract a contact: variable ``contact`` (a ``Contact``)."""
    s += system("Extract the contact (name and email) as JSON.")
    s += user(text)
    s += assistant(gen("contact", json_schema=Contact, max_tokens=max_tokens, temperature=0))


@program
def summarize(s: Any, text: str, max_tokens: int = 48) -> None:
    """One-sentence summary: variable ``summary``."""
    s += user(f"Summarize in one sentence:\n{text}")
    s += assistant(gen("summary", max_tokens=max_tokens, temperature=0, stop="\n"))


PROGRAMS: dict[str, Program] = {p.name: p for p in (qa, sentiment, extract_contact, summarize)}


def main(engine: Any = None, max_tokens: int = 24) -> dict[str, Any]:
    """Run qa, sentiment and summarize once; return their variables."""
    backend = default_engine(engine)
    results = {
        "qa": qa.run(backend, question="What is the capital of Italy?", max_tokens=max_tokens).variables(),
        "sentiment": sentiment.run(backend, text="I love this bakery!").variables(),
        "summarize": summarize.run(backend, text="The cat sat on the mat all day long, watching birds.",
                                   max_tokens=max_tokens).variables(),
    }
    for name, variables in results.items():
        print(f"{name}: {variables}")
    return results


if __name__ == "__main__":
    main()
