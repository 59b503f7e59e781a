"""Same tokens as HF transformers: greedy decoding and prefill log-probabilities.

The reference is HF ``generate`` on the same weights (fp32), each prompt alone; Arbor runs
all prompts in one batch. Log-probabilities are compared instead of raw logits (they
differ from logits by one constant per row, so agreement within 1e-3 bounds the logit
differences up to that shift).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime import Engine, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "1 + 1 = 2. 2 + 2 =",
]


def hf_greedy(hf_model: torch.nn.Module, ids: list[int], new_tokens: int, eos: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos[0])  # type: ignore[operator]
    tokens: list[int] = out[0, len(ids):].tolist()
    return [t for t in tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]]


def hf_logprobs(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:  # [L, V]
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)


def load_hf(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def check_against_hf(engine: Engine, hf_model: torch.nn.Module, prompts: list[list[int]]) -> None:
    eos = engine.eos_token_ids
    params = SamplingParams(max_new_tokens=32, temperature=0.0, prompt_logprobs=True,
                            logprobs=True, top_logprobs=5)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    for ids, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf_model, ids, 32, eos), f"prompt {ids[:8]}..."
        ref = hf_logprobs(hf_model, ids + out.token_ids)
        ours_prompt = torch.tensor(out.prompt_logprobs[1:], dtype=torch.float32)
        ref_prompt = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)]
        assert torch.allclose(ours_prompt, ref_prompt, atol=1e-3, rtol=0)
        ref_out = ref[torch.arange(len(ids) - 1, len(ids) - 1 + len(out.token_ids)), torch.tensor(out.token_ids)]
        assert out.logprobs is not None
        assert torch.allclose(torch.tensor(out.logprobs), ref_out, atol=1e-3, rtol=0)
        assert out.top_logprobs is not None
        first_top = out.top_logprobs[0]
        ref_top = ref[len(ids) - 1].topk(5)
        assert list(first_top) == ref_top.indices.tolist()
    engine.wait_idle()
    engine.check_integrity()


@pytest.fixture(scope="module")
def default_hf() -> torch.nn.Module:
    from runtime.model.loader import resolve_model_dir

    return load_hf(resolve_model_dir("default"))  # transformers' conversion of the same file


@pytest.mark.slow
def test_default_model_batch_matches_hf_alone(default_engine: Engine, default_hf: torch.nn.Module) -> None:
    prompts = [default_engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    check_against_hf(default_engine, default_hf, prompts)


# NOTE: the quick run keeps the Llama at both page sizes; tests/runtime/model/test_llama.py
# checks every architecture's logits against HF in milliseconds.
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                  pytest.param("llama3", marks=pytest.mark.slow)])
def test_tiny_models_match_hf(arch: str, page_size: int, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    engine = Engine(model=str(model_dir), page_size=page_size, num_pages=2048 // page_size)
    try:
        rng = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 49152, (n,), generator=rng).tolist() for n in (1, 7, 16, 33, 70)]
        check_against_hf(engine, load_hf(model_dir), prompts)
    finally:
        engine.close()


@pytest.mark.slow
def test_shared_prefix_and_chunked_prefill_keep_tokens(tiny_llama_dir: Path) -> None:
    """Prefix reuse and chunked prefill change the schedule, never the tokens."""
    base = list(range(100, 160))
    prompts = [base + [7, 8, 9], base + [10, 11], base[:30] + [5]]
    hf = load_hf(tiny_llama_dir)
    for kwargs in ({}, {"max_prefill_tokens": 16}, {"disable_prefix_cache": True}):
        engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=512, **kwargs)
        try:
            check_against_hf(engine, hf, prompts)
            check_against_hf(engine, hf, prompts)  # second round: served from the cache
        finally:
            engine.close()


def test_shared_prefix_attention_keeps_hf_tokens(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests decoding over one radix-shared prefix attend to it once per group (the
    torch path's cascade); tokens and log-probs stay HF's."""
    from runtime.model.runner import ModelRunner

    seen: list[int] = []
    real = ModelRunner._shared_prefixes

    def spy(self: ModelRunner, table: torch.Tensor, starts: list[int]) -> tuple:  # type: ignore[type-arg]
        groups = real(self, table, starts)
        seen.extend(int(g.pages.numel()) for g in groups)
        return groups

    monkeypatch.setattr(ModelRunner, "_shared_prefixes", spy)
    base = [(7 * i) % 300 + 3 for i in range(160)]
    prompts = [base + [11 + i, 12 + i] for i in range(8)]  # 7 x 160 shared tokens >= 1024
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=512, speculation=False)
    try:
        check_against_hf(engine, load_hf(tiny_llama_dir), prompts)
    finally:
        engine.close()
    assert seen and max(seen) == 40  # 160 shared tokens = 40 pages of 4
