"""Incremental detokenization: whole characters only, stop strings never half-shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.output.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def stream(tokenizer, text: str, stop: tuple[str, ...] = (), stop_regex: tuple[str, ...] = (),  # type: ignore[no-untyped-def]
           min_tokens: int = 0) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, stop, skip_special_tokens=True, stop_regex=stop_regex)
    deltas = []
    for n in range(1, len(ids) + 1):
        detok.add(ids[:n], check_stop=n >= min_tokens)
        deltas.append(detok.take(final=False))
        if detok.stopped:
            break
    if not detok.stopped:
        detok.finish(ids)
    deltas.append(detok.take(final=True))
    return deltas, detok


def test_multibyte_characters_are_never_split(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "héllo 🎉 wörld 日本語 🚀!"
    deltas, _ = stream(tokenizer, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_cut_and_never_emitted(tokenizer) -> None:  # type: ignore[no-untyped-def]
    deltas, detok = stream(tokenizer, "one two three STOP four five", stop=("STOP",))
    assert "".join(deltas) == "one two three "
    assert detok.stopped
    assert all("S" not in d for d in deltas)  # not even the first letter leaked early


def test_stop_string_spanning_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    deltas, detok = stream(tokenizer, "alpha beta<|end|> gamma", stop=("<|end|>", "zzz"))
    assert "".join(deltas) == "alpha beta" and detok.stopped


def test_stop_regex_cuts_at_the_match_and_holds_back_partial_matches(tokenizer) -> None:  # type: ignore[no-untyped-def]
    deltas, detok = stream(tokenizer, "Answer: 42 apples. More text.", stop_regex=(r"\d+ apples\.",))
    assert "".join(deltas) == "Answer: " and detok.stopped
    assert all(not any(c.isdigit() for c in d) for d in deltas)  # "42" was held back, then cut


def test_stop_regex_partial_match_that_fails_is_released(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "id 42 pears, then 7 plums."
    deltas, detok = stream(tokenizer, text, stop_regex=(r"\d+ apples",))
    assert "".join(deltas) == text and not detok.stopped
    assert "42" in "".join(deltas[:-1])  # released as soon as " pears" ruled the match out


def test_stops_wait_for_min_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "stop here, then go on and stop there"
    deltas, detok = stream(tokenizer, text, stop_regex=(r"stop \w+",), min_tokens=3)
    assert "".join(deltas) == "stop here, then go on and " and detok.stopped
