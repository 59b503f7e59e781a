"""The eval's sample sets: shipped, fixed, and the stdlib corpus chosen deterministically."""

from __future__ import annotations

import json

from runtime.eval.samples import DATA_DIR, load_samples, qa_prompt, stdlib_docstrings


def test_sets_load_in_their_fixed_order() -> None:
    samples = load_samples()
    assert len(samples.prompts) == 20 and samples.prompts[0].startswith("The capital of France")
    assert len(samples.extraction) == 10 and samples.extraction[0].expected == {"name": "Maria", "age": 34}
    assert len(samples.qa) == 12 and samples.qa[0].answer == "Rome"
    assert len(samples.corpus) == 16 and all(len(doc) >= 300 for doc in samples.corpus)


def test_the_corpus_is_deterministic_and_identified_by_its_digest() -> None:
    assert stdlib_docstrings() == stdlib_docstrings()
    assert load_samples().corpus_digest == load_samples().corpus_digest
    assert stdlib_docstrings(3) == stdlib_docstrings()[:3]
    assert load_samples().limited(2).corpus_digest != load_samples().corpus_digest


def test_limited_keeps_the_first_samples_of_each_set() -> None:
    small = load_samples().limited(2)
    full = load_samples()
    assert small.prompts == full.prompts[:2] and small.qa == full.qa[:2]
    assert small.extraction == full.extraction[:2] and small.corpus == full.corpus[:2]


def test_every_extraction_answer_satisfies_its_schema() -> None:
    import jsonschema

    for line in (DATA_DIR / "extraction.jsonl").read_text().splitlines():
        row = json.loads(line)
        jsonschema.validate(row["expected"], row["schema"])


def test_qa_prompt_is_few_shot_and_ends_where_the_answer_starts() -> None:
    prompt = qa_prompt("What is 2 + 3?")
    assert prompt.count("Q: ") == 4 and prompt.endswith("Q: What is 2 + 3?\nA:")
