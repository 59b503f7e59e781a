"""Extraction job: one schema-constrained program over a JSONL file, results to JSONL.

Each input line is ``{"id": ..., "text": ...}``; each output line is
``{"id": ..., "record": {...}}`` (validated against ``Person``) or
``{"id": ..., "error": "..."}`` when a document's output failed, so one bad document
never stops the job.

    python examples/extraction.py [--input examples/data/docs.jsonl] [--output out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pydantic

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import default_engine  # noqa: E402

from frontend_dsl import ProgramError, assistant, gen, program, system, user  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "docs.jsonl"


class Person(pydantic.BaseModel):
    name: str
    occupation: str
    city: str
    age: int


@program
def extract_person(s: Any, text: str, max_tokens: int = 64) -> None:
    s += system("Extract the person described by the user as JSON with the fields "
                "name, occupation, city and age.")
    s += user(text)
    s += assistant(gen("person", json_schema=Person, max_tokens=max_tokens, temperature=0))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def result_line(doc: dict[str, Any], outcome: Any) -> dict[str, Any]:
    """The output record for one document."""
    if isinstance(outcome, ProgramError):
        return {"id": doc["id"], "error": str(outcome)}
    return {"id": doc["id"], "record": outcome["person"].model_dump()}


def main(engine: Any = None, input_path: Path = DATA, output_path: Path = Path("extracted.jsonl"),
         max_tokens: int = 64, max_concurrency: int = 16) -> list[dict[str, Any]]:
    """Run the job; return the output lines (also written to ``output_path``)."""
    docs = read_jsonl(input_path)
    outcomes = extract_person.run_batch(
        [{"text": d["text"], "max_tokens": max_tokens} for d in docs],
        max_concurrency=max_concurrency, progress=True, backend=default_engine(engine),
        return_exceptions=True,
    )
    lines = [result_line(d, o) for d, o in zip(docs, outcomes, strict=True)]
    with output_path.open("w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    num_ok = sum("record" in line for line in lines)
    print(f"{num_ok}/{len(lines)} documents extracted -> {output_path}")
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--input", type=Path, default=DATA)
    parser.add_argument("--output", type=Path, default=Path("extracted.jsonl"))
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    main(input_path=args.input, output_path=args.output, max_tokens=args.max_tokens)
