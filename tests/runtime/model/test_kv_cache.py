"""The KV pool in int8 / fp8: bytes per token with the scales, the pool's capacity at a
fixed memory budget, and the scheduler admitting that many more requests at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import Engine, SamplingParams, engine_setup
from runtime.config import EngineConfig
from runtime.model.kv_cache import KVCache

# The default model (SmolLM2-135M): 30 layers, 3 KV heads of 64 dims.
DEFAULT_MODEL = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
                 "num_hidden_layers": 30, "max_position_embeddings": 8192}


def test_bytes_per_token_count_the_scales() -> None:
    fp32 = KVCache.bytes_per_token(30, 3, 64, torch.float32)
    assert fp32 == 2 * 30 * 3 * 64 * 4 == 46_080
    for dtype in (torch.int8, torch.float8_e4m3fn):
        assert KVCache.bytes_per_token(30, 3, 64, dtype) == 2 * 30 * 3 * (64 + 4) == 12_240
    assert KVCache.bytes_per_token(30, 3, 64, torch.bfloat16) == 23_040


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_the_same_memory_holds_over_3_5x_the_1024_token_sequences(
        monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype) -> None:
    """Default model, 0.95 GiB for the pool: 21 sequences of 1,024 tokens in fp32, 81 in 8 bits."""
    monkeypatch.setattr(engine_setup, "_free_memory_bytes", lambda device: 1 << 30)
    cfg = EngineConfig(page_size=16, mem_fraction=0.95)
    budget = {}
    for dtype in (torch.float32, kv_dtype):
        num_pages, _ = engine_setup.size_pool(cfg, DEFAULT_MODEL, torch.device("cpu"), dtype)
        budget[dtype] = (num_pages - 1) // (1024 // 16)  # page 0 is padding
    assert budget == {torch.float32: 21, kv_dtype: 81}
    assert budget[kv_dtype] / budget[torch.float32] >= 3.5


def _max_decoding_at_once(tiny_llama_dir: Path, kv_cache_dtype: str) -> int:
    engine = Engine(model=str(tiny_llama_dir), kv_cache_dtype=kv_cache_dtype, page_size=16,
                    mem_fraction=0.5, num_threads=1, freeze_gc=False, speculation=False,
                    max_prefill_tokens=8192, chunked_prefill_size=8192)  # memory binds, not prefill
    seen = [0]

    def hook(batch: Any) -> None:
        seen[0] = max(seen[0], len(batch.decode))

    engine.add_step_hook(hook)
    try:
        prompts = [[300 + i] + list(range(1000, 1255)) for i in range(16)]  # 256 tokens each
        outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(
            max_new_tokens=8, temperature=0.0, ignore_eos=True))
        assert all(len(o.token_ids) == 8 for o in outs)
        engine.wait_idle()
        engine.check_integrity()
    finally:
        engine.close()
    return seen[0]


def test_the_scheduler_admits_more_requests_into_an_8bit_pool(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same bytes (1,300 fp32 tokens of the tiny model: 2 layers, 2 KV heads of 16 dims,
    512 bytes a token vs 160 in int8) hold 4 requests of 256 + 16 tokens in fp32, 15 in int8."""
    monkeypatch.setattr(engine_setup, "_free_memory_bytes", lambda device: 2 * 1300 * 512)
    fp32, int8 = _max_decoding_at_once(tiny_llama_dir, "auto"), _max_decoding_at_once(tiny_llama_dir, "int8")
    assert fp32 <= 4 and int8 >= 3 * fp32, (fp32, int8)


@pytest.mark.slow
def test_default_model_next_tokens_agree_with_fp32_kv(default_engine: Engine) -> None:
    """Teacher-forced on the eval's 20 prompts (539 positions). Measured: int8 99.6% top-1
    agreement, mean KL 0.0008 nats; fp8 e4m3 (3 mantissa bits) 98.0%, 0.0043 nats."""
    from runtime.eval.samples import load_samples

    prompts = [default_engine.tokenizer(text)["input_ids"] for text in load_samples().prompts]
    base = [torch.log_softmax(default_engine.score(ids)[:-1], -1) for ids in prompts]
    positions = sum(b.shape[0] for b in base)
    assert positions > 500
    for kv_cache_dtype, min_agreement, max_kl in (("int8", 0.97, 0.002), ("fp8", 0.95, 0.01)):
        engine = Engine(model="default", weights="fp32", kv_cache_dtype=kv_cache_dtype, page_size=16, num_pages=1024,
                        freeze_gc=False)
        try:
            agree, kl = 0, 0.0
            for ids, b in zip(prompts, base, strict=True):
                c = torch.log_softmax(engine.score(ids)[:-1], -1)
                agree += int((b.argmax(-1) == c.argmax(-1)).sum())
                kl += float((b.exp() * (b - c)).sum())
        finally:
            engine.close()
        assert agree / positions >= min_agreement, (kv_cache_dtype, agree / positions)
        assert kl / positions < max_kl, (kv_cache_dtype, kl / positions)


def test_prefix_cache_reuses_8bit_pages_like_any_other(tiny_llama_dir: Path) -> None:
    """Pages are pages: a second request on a cached int8 prefix reuses it, and gets the
    tokens an engine without a prefix cache computes from scratch."""
    prefix = list(range(2000, 2100))
    prompts = [prefix + [300 + i] * 5 for i in range(3)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    outputs = {}
    for disable in (False, True):
        engine = Engine(model=str(tiny_llama_dir), kv_cache_dtype="int8", page_size=4, num_pages=256,
                        num_threads=1, freeze_gc=False, disable_prefix_cache=disable)
        try:
            first = engine.generate(input_ids=prompts[0], sampling_params=params)
            rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
            outputs[disable] = [o.token_ids for o in first + rest]
            assert all(o.num_cached_tokens == (0 if disable else 100) for o in rest)
            engine.wait_idle()
            engine.check_integrity()
        finally:
            engine.close()
    assert outputs[False] == outputs[True]
