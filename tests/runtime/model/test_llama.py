"""The Llama-family model: config parsing, and logits equal to HF transformers' on the same
random weights, for a prefill and for a decode step that reads its prefix from pool pages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.model.attention import AttentionMetadata
from runtime.model.kv_cache import KVCache
from runtime.model.llama import LlamaForCausalLM, ModelArgs
from runtime.model.loader import load_model

PAGE_SIZE = 4
PAGES = [5, 2, 7]  # the request's pages, out of order: position p lives in PAGES[p // 4]
IDS = [1, 504, 3120, 42, 9, 30000, 77, 1234, 8]  # 8 prompt tokens, then one decode token

LLAMA_CONFIG: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "rope_theta": 10000.0,
}


def i32(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def slots(positions: range) -> torch.Tensor:
    return torch.tensor([PAGES[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in positions])


def prefill_meta(kv: KVCache, num_tokens: int) -> AttentionMetadata:
    return AttentionMetadata(
        kv=kv, out_slots=slots(range(num_tokens)), num_extend_tokens=num_tokens,
        extend_page_table=i32([PAGES]), extend_prefix_lens=i32([0]), extend_lens=i32([num_tokens]),
        extend_qo_indptr=i32([0, num_tokens]),
        decode_page_table=torch.zeros(0, 1, dtype=torch.int32), decode_seq_lens=i32([]),
    )


def decode_meta(kv: KVCache, position: int) -> AttentionMetadata:
    return AttentionMetadata(
        kv=kv, out_slots=slots(range(position, position + 1)), num_extend_tokens=0,
        extend_page_table=torch.zeros(0, 1, dtype=torch.int32), extend_prefix_lens=i32([]),
        extend_lens=i32([]), extend_qo_indptr=i32([0]),
        decode_page_table=i32([PAGES]), decode_seq_lens=i32([position + 1]),
    )


def test_llama_config_is_read_with_its_defaults() -> None:
    args = ModelArgs.from_hf_config(LLAMA_CONFIG)
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim) == (2, 4, 2, 16)
    assert args.rope == {"rope_theta": 10000.0}
    assert not args.qkv_bias and not args.tie_word_embeddings and args.rms_norm_eps == 1e-5
    bare = {k: v for k, v in LLAMA_CONFIG.items() if k not in ("num_key_value_heads", "rope_theta")}
    assert ModelArgs.from_hf_config(bare).num_kv_heads == 4  # MHA when the key is absent
    assert ModelArgs.from_hf_config(bare).rope == {"rope_theta": 10000.0}


def test_qwen2_has_qkv_bias_and_explicit_head_dim_wins() -> None:
    args = ModelArgs.from_hf_config({**LLAMA_CONFIG, "model_type": "qwen2", "head_dim": 32,
                                     "tie_word_embeddings": True})
    assert args.qkv_bias and args.tie_word_embeddings and args.head_dim == 32


def test_both_rope_config_layouts_give_the_same_settings() -> None:
    """transformers 5 writes ``rope_parameters``; 4.x wrote ``rope_scaling`` + ``rope_theta``."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    v4 = ModelArgs.from_hf_config({**LLAMA_CONFIG, "rope_theta": 500000.0, "rope_scaling": scaling})
    v5 = ModelArgs.from_hf_config({**LLAMA_CONFIG, "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert v4.rope == v5.rope == {**scaling, "rope_theta": 500000.0}


def test_unsupported_architecture_is_named() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelArgs.from_hf_config({**LLAMA_CONFIG, "model_type": "gpt2"})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3"])
def test_prefill_and_decode_logits_equal_hf(arch: str, request: pytest.FixtureRequest) -> None:
    """Llama (GQA), Qwen2 (q/k/v bias, tied head), Llama 3 (scaled rope, MQA)."""
    from transformers import AutoModelForCausalLM

    model_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    ours = load_model(model_dir, torch.device("cpu"), torch.float32, max_positions=64)
    assert isinstance(ours, LlamaForCausalLM)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([IDS])).logits[0].float()  # [9, V]
    args = ours.args
    kv = KVCache(args.num_layers, num_pages=8, page_size=PAGE_SIZE, num_kv_heads=args.num_kv_heads,
                 head_dim=args.head_dim, dtype=torch.float32, device=torch.device("cpu"))

    prompt_len = len(IDS) - 1
    prefill = ours(torch.tensor(IDS[:-1]), torch.arange(prompt_len), prefill_meta(kv, prompt_len),
                   torch.arange(prompt_len))  # logits of every prompt position
    assert prefill.shape == (prompt_len, args.vocab_size)
    torch.testing.assert_close(prefill, expected[:-1], atol=1e-4, rtol=1e-4)

    decode = ours(torch.tensor(IDS[-1:]), torch.tensor([prompt_len]), decode_meta(kv, prompt_len),
                  torch.tensor([0]))  # its K/V goes to page 7; the 8 cached tokens are read from pages 5 and 2
    torch.testing.assert_close(decode, expected[-1:], atol=1e-4, rtol=1e-4)
    assert decode.argmax().item() == expected[-1].argmax().item()
