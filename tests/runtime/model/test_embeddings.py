"""``Engine.embed``: the final-norm hidden state of each input's last token, L2-normalized,
equal to transformers' own on the tiny fp32 Llama; batched into passes, deterministic."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import Engine
from runtime.errors import InvalidRequestError, PromptTooLongError

INPUTS = [[1, 5, 9, 20], [3, 4], [7] * 30, [8, 11] * 25, [42]]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Any]:
    eng = Engine(model=str(tiny_llama_dir), num_pages=256, max_model_len=64, num_threads=1, seed=0,
                 weights="fp32")
    yield eng
    eng.close()


def transformers_embedding(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        last = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    return torch.nn.functional.normalize(last, dim=-1)


def test_equals_transformers_last_hidden_state(engine: Any, tiny_llama_dir: Path) -> None:
    got = engine.embed(INPUTS)
    assert got.shape == (len(INPUTS), engine.model.args.hidden_size) and got.dtype == torch.float32
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(INPUTS)))
    for row, ids in zip(got, INPUTS, strict=True):
        torch.testing.assert_close(row, transformers_embedding(tiny_llama_dir, ids), atol=1e-4, rtol=1e-4)


def test_batching_and_passes_do_not_change_an_embedding(engine: Any) -> None:
    # INPUTS hold 111 tokens: two passes of at most max_model_len (64) tokens
    together = engine.embed(INPUTS)
    alone = torch.cat([engine.embed([ids]) for ids in INPUTS])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert torch.equal(engine.embed(INPUTS), together)  # deterministic


def test_the_engine_still_generates_and_keeps_its_pages(engine: Any) -> None:
    from runtime import SamplingParams

    before = engine.generate("Hello", SamplingParams(max_new_tokens=4, temperature=0))[0].text
    engine.embed(INPUTS)
    assert engine.generate("Hello", SamplingParams(max_new_tokens=4, temperature=0))[0].text == before
    assert engine.wait_idle(30)
    engine.check_integrity()


@pytest.mark.parametrize(("inputs", "error"), [
    ([], InvalidRequestError),
    ([[1, 2], []], InvalidRequestError),
    ([[1, -1]], InvalidRequestError),
    ([[10**9]], InvalidRequestError),
    ([[5] * 65], PromptTooLongError),
])
def test_bad_inputs_are_refused(engine: Any, inputs: list[list[int]], error: type[Exception]) -> None:
    with pytest.raises(error):
        engine.embed(inputs)


def test_a_qwen2_embedding_equals_transformers(tiny_qwen2_dir: Path) -> None:
    """Tied embeddings and q/k/v bias: the hidden state is the family's, before any head."""
    eng = Engine(model=str(tiny_qwen2_dir), num_pages=64, max_model_len=64, num_threads=1, seed=0, weights="fp32")
    try:
        got = eng.embed(INPUTS[:2])
    finally:
        eng.close()
    for row, ids in zip(got, INPUTS[:2], strict=True):
        torch.testing.assert_close(row, transformers_embedding(tiny_qwen2_dir, ids), atol=1e-4, rtol=1e-4)
