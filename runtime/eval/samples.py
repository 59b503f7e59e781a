"""The fixed sample sets that ``arbor eval`` replays, shipped with the package (``data/``)
or built from text every machine has, so an eval downloads nothing.

- ``prompts``: 20 short texts (prose, code, chat turns, arithmetic); every position is a
  next-token prediction to compare (top-1 agreement, KL) and each is also a prompt for
  greedy generation (greedy match, speed).
- ``corpus``: docstrings of pure-Python standard-library modules, for perplexity; chosen
  deterministically (modules, then names, in sorted order) and identified by a digest,
  since docstrings change between Python versions: compare reports with equal digests.
- ``extraction``: texts with a JSON schema and the exact object expected.
- ``qa``: short questions with one-word answers, asked few-shot.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
# Pure-Python modules (their docstrings are in the .py files, not in a C build).
CORPUS_MODULES = ("argparse", "calendar", "contextlib", "dataclasses", "fractions", "heapq",
                  "json", "shlex", "statistics", "string", "textwrap", "difflib")
MIN_DOC_CHARS = 300  # shorter docstrings say too little to score
QA_SHOTS = (("What is the capital of France?", "Paris"),
            ("How many wheels does a bicycle have?", "2"),
            ("What color is snow?", "White"))


@dataclass(frozen=True)
class ExtractionSample:
    text: str
    schema: dict[str, Any]  # JSON schema of the answer (also the generation's constraint)
    expected: Any  # the exact parsed object that counts as a match


@dataclass(frozen=True)
class QASample:
    question: str
    answer: str  # compared case-insensitively with the first line generated


@dataclass(frozen=True)
class SampleSets:
    prompts: list[str]
    corpus: list[str]
    extraction: list[ExtractionSample]
    qa: list[QASample]

    @property
    def corpus_digest(self) -> str:
        """sha256 (first 16 hex digits) of the corpus: equal digests, equal texts."""
        return hashlib.sha256("\0".join(self.corpus).encode()).hexdigest()[:16]

    def limited(self, limit: int | None) -> SampleSets:
        """At most ``limit`` samples of each set (a quick eval); None keeps them all."""
        if limit is None:
            return self
        return SampleSets(self.prompts[:limit], self.corpus[:limit], self.extraction[:limit],
                          self.qa[:limit])


def _jsonl(name: str) -> list[dict[str, Any]]:
    with open(DATA_DIR / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def stdlib_docstrings(num_docs: int = 16) -> list[str]:
    """The first ``num_docs`` docstrings of at least ``MIN_DOC_CHARS`` characters, walking
    ``CORPUS_MODULES`` in order: each module's own docstring, then its public classes
    and functions (defined in it) by name."""
    docs: list[str] = []
    for module_name in CORPUS_MODULES:
        module = importlib.import_module(module_name)
        objects = [module] + [obj for name, obj in sorted(vars(module).items())
                              if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
                              and getattr(obj, "__module__", None) == module_name]
        for obj in objects:
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= MIN_DOC_CHARS:
                docs.append(doc)
                if len(docs) == num_docs:
                    return docs
    return docs


def load_samples() -> SampleSets:
    """Every set, in its fixed order."""
    return SampleSets(
        prompts=[row["text"] for row in _jsonl("prompts.jsonl")],
        corpus=stdlib_docstrings(),
        extraction=[ExtractionSample(r["text"], r["schema"], r["expected"]) for r in _jsonl("extraction.jsonl")],
        qa=[QASample(r["question"], r["answer"]) for r in _jsonl("qa.jsonl")],
    )


def qa_prompt(question: str) -> str:
    """The few-shot prompt of one question (the answer is the line after ``A:``)."""
    shots = "".join(f"Q: {q}\nA: {a}\n" for q, a in QA_SHOTS)
    return f"{shots}Q: {question}\nA:"


def extraction_message(sample: ExtractionSample) -> str:
    """The user message asking for the sample's fields as JSON."""
    fields = ", ".join(sample.schema.get("properties", {}))
    return f"Extract {fields} from this text as a JSON object.\nText: {sample.text}"
