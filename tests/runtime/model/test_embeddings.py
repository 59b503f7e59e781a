"""``Engine.embed``: the final-norm hidden state of each input's last token (or the mean
over its tokens, or its first), cut to ``dimensions``, L2-normalized, equal to
transformers' own on the tiny fp32 Llama; batched into passes, deterministic; the model's
own pooling read from its sentence-transformers files."""

from __future__ import annotations

import json
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


def transformers_embedding(model_dir: Path, ids: list[int], pooling: str = "last",
                           dimensions: int | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    pooled = {"last": states[-1], "cls": states[0], "mean": states.mean(dim=0)}[pooling]
    return torch.nn.functional.normalize(pooled[:dimensions], dim=-1)


def test_equals_transformers_last_hidden_state(engine: Any, tiny_llama_dir: Path) -> None:
    got = engine.embed(INPUTS)
    assert got.shape == (len(INPUTS), engine.model.args.hidden_size) and got.dtype == torch.float32
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(INPUTS)))
    for row, ids in zip(got, INPUTS, strict=True):
        torch.testing.assert_close(row, transformers_embedding(tiny_llama_dir, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("pooling", "dimensions"), [("mean", None), ("cls", None), ("last", 16), ("mean", 8)])
def test_pooling_and_truncation_equal_transformers(engine: Any, tiny_llama_dir: Path, pooling: str,
                                                   dimensions: int | None) -> None:
    got = engine.embed(INPUTS, pooling=pooling, dimensions=dimensions)
    assert got.shape == (len(INPUTS), dimensions or engine.model.args.hidden_size)
    for row, ids in zip(got, INPUTS, strict=True):  # NOTE: cut first, then renormalized
        want = transformers_embedding(tiny_llama_dir, ids, pooling, dimensions)
        torch.testing.assert_close(row, want, atol=1e-4, rtol=1e-4)


def test_the_model_files_state_the_pooling(tmp_path: Path) -> None:
    from runtime.model.pooling import model_pooling

    assert model_pooling(tmp_path) is None  # no sentence-transformers files
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    assert model_pooling(tmp_path) == "mean"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    assert model_pooling(tmp_path) is None  # a pooling Arbor does not do: the default stays


def test_an_engine_pools_as_its_model_states(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "modules.json").write_text(json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    eng = Engine(model=str(tmp_path), num_pages=64, max_model_len=64, num_threads=1, seed=0, weights="fp32")
    try:
        assert eng.embedding_pooling == "mean"
        torch.testing.assert_close(eng.embed(INPUTS[:2]), eng.embed(INPUTS[:2], pooling="mean"))
        torch.testing.assert_close(eng.embed(INPUTS[:1])[0], transformers_embedding(tiny_llama_dir, INPUTS[0], "mean"),
                                   atol=1e-4, rtol=1e-4)
    finally:
        eng.close()


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


@pytest.mark.parametrize(("pooling", "dimensions"), [("max", None), ("last", 0), ("last", 65)])
def test_a_bad_pooling_or_dimensions_is_refused(engine: Any, pooling: str, dimensions: int | None) -> None:
    with pytest.raises(InvalidRequestError):
        engine.embed(INPUTS[:1], pooling=pooling, dimensions=dimensions)  # type: ignore[arg-type]


def test_a_qwen2_embedding_equals_transformers(tiny_qwen2_dir: Path) -> None:
    """Tied embeddings and q/k/v bias: the hidden state is the family's, before any head."""
    eng = Engine(model=str(tiny_qwen2_dir), num_pages=64, max_model_len=64, num_threads=1, seed=0, weights="fp32")
    try:
        got = eng.embed(INPUTS[:2])
    finally:
        eng.close()
    for row, ids in zip(got, INPUTS[:2], strict=True):
        torch.testing.assert_close(row, transformers_embedding(tiny_qwen2_dir, ids), atol=1e-4, rtol=1e-4)
