"""Incremental detokenization: whole characters only, stop strings never half-shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.output.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def stream(tokenizer, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:  # type: ignore[no-untyped-def]
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, stop, skip_special_tokens=True)
    deltas = []
    for n in range(1, len(ids) + 1):
        detok.add(ids[:n])
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
