"""The model runner on hand-built ``ForwardBatch`` values: which rows come back, in which
order, and that paged KV written by one pass is read by the next (against HF)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from runtime.model.kv_cache import KVCache
from runtime.model.loader import load_model
from runtime.model.runner import ModelRunner
from runtime.scheduler.batch import ForwardBatch, ForwardSeq

PAGE = 4
PROMPT = [1, 57, 300, 4021, 9, 77, 12]  # 7 tokens: pages 5 and 6 (positions 0-3, 4-6)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    model = load_model(tiny_llama_dir, torch.device("cpu"), torch.float32, 256)
    a = model.args
    kv = KVCache(a.num_layers, 64, PAGE, a.num_kv_heads, a.head_dim, torch.float32, torch.device("cpu"))
    return ModelRunner(model, kv, torch.device("cpu"))


@pytest.fixture(scope="module")
def hf_logits(tiny_llama_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT + [500, 600]])).logits[0]  # [9, V]


def test_prefill_then_decode_reads_the_pages_the_prefill_wrote(runner: ModelRunner,
                                                                hf_logits: torch.Tensor) -> None:
    with torch.inference_mode():
        first = runner.forward(ForwardBatch(
            extend=(ForwardSeq("a", tuple(PROMPT), 0, (5, 6), "last"),), decode=()))
        second = runner.forward(ForwardBatch(
            extend=(), decode=(ForwardSeq("a", (500,), 7, (5, 6, 9), "last"),)))
    assert first.sample_ids == ["a"] and second.sample_ids == ["a"]
    torch.testing.assert_close(first.logits[0], hf_logits[6], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(second.logits[0], hf_logits[7], atol=2e-4, rtol=1e-4)


def test_rows_come_back_by_kind_and_order(runner: ModelRunner, hf_logits: torch.Tensor) -> None:
    """A mid-prompt chunk gives no sample row; a verify seq gives every row; prompt
    logprob rows give log p(next prompt token); samples come extend-first."""
    chunk = ForwardSeq("c", tuple(PROMPT[:4]), 0, (20,), "none",
                       prompt_logprob_rows=((0, 1, PROMPT[1]), (3, 4, PROMPT[4])))
    verify = ForwardSeq("v", tuple(PROMPT), 0, (30, 31), "all")
    tail = ForwardSeq("t", tuple(PROMPT[:5]), 0, (40, 41), "last")
    with torch.inference_mode():
        out = runner.forward(ForwardBatch(extend=(chunk, verify, tail), decode=()))
    assert out.sample_ids == ["t"]
    torch.testing.assert_close(out.logits[0], hf_logits[4], atol=2e-4, rtol=1e-4)
    assert list(out.verify_logits) == ["v"] and out.verify_logits["v"].shape == (7, hf_logits.shape[1])
    torch.testing.assert_close(out.verify_logits["v"], hf_logits[:7], atol=2e-4, rtol=1e-4)
    logp = torch.log_softmax(hf_logits, dim=-1)
    positions = [pos for pos, _ in out.prompt_logprobs["c"]]
    assert positions == [1, 4]
    expected = [logp[0, PROMPT[1]].item(), logp[3, PROMPT[4]].item()]
    assert [lp for _, lp in out.prompt_logprobs["c"]] == pytest.approx(expected, abs=1e-4)


def test_the_runner_gets_values_it_cannot_change() -> None:
    seq = ForwardSeq("a", (1, 2), 0, (3,), "last")
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'append'"):
        seq.token_ids.append(5)  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        seq.start = 4  # type: ignore[misc]
