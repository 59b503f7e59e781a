"""Engine settings: each refused value fails at construction with a message naming what is
accepted, the same from ``Engine(...)``, ``EngineConfig(...)`` and the ``arbor`` flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import Engine, InvalidRequestError, engine_setup
from runtime.cli import main
from runtime.config import EngineConfig

KV_DTYPE_MESSAGE = ("kv_cache_dtype must be 'auto' (the model's dtype; KV cache quantization is "
                    "not implemented), got 'fp8'")


def test_kv_cache_dtype_other_than_auto_is_refused(tiny_llama_dir: Path) -> None:
    assert EngineConfig(kv_cache_dtype="auto").kv_cache_dtype == "auto"
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(kv_cache_dtype="fp8")  # type: ignore[arg-type]
    assert str(info.value) == KV_DTYPE_MESSAGE
    with pytest.raises(InvalidRequestError) as info:
        Engine(model=str(tiny_llama_dir), kv_cache_dtype="fp8")
    assert str(info.value) == KV_DTYPE_MESSAGE


@pytest.mark.parametrize("command", [["generate", "Hi"], ["serve"]])
def test_the_kv_cache_dtype_flag_gives_the_same_message(
        command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--model", "nowhere", "--kv-cache-dtype", "fp8"]) == 2
    assert capsys.readouterr().err == f"arbor: error: {KV_DTYPE_MESSAGE}\n"


def test_num_pages_and_mem_fraction_are_not_both_given(tiny_llama_dir: Path) -> None:
    assert EngineConfig(num_pages=64).mem_fraction is None
    assert EngineConfig(mem_fraction=0.3).num_pages is None
    with pytest.raises(InvalidRequestError, match="give num_pages or mem_fraction, not both"):
        EngineConfig(num_pages=64, mem_fraction=0.3)
    with pytest.raises(InvalidRequestError, match="give num_pages or mem_fraction, not both"):
        Engine(model=str(tiny_llama_dir), num_pages=64, mem_fraction=0.3)
    with pytest.raises(InvalidRequestError, match=r"mem_fraction must be in \(0, 0.95\]"):
        EngineConfig(mem_fraction=0.99)


@pytest.mark.parametrize(("settings", "num_pages"), [
    ({}, 76),  # DEFAULT_MEM_FRACTION: 0.15 x 512
    ({"mem_fraction": 0.5}, 256),
    ({"num_pages": 64}, 64),
])
def test_the_kv_pool_size(monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any], num_pages: int) -> None:
    # 1 MiB free; a token's KV takes 2 (K, V) x 2 layers x 2 heads x 64 dims x 4 bytes = 2 KiB,
    # so 1 MiB holds 512 one-token pages.
    monkeypatch.setattr(engine_setup, "_free_memory_bytes", lambda device: 1 << 20)
    hf_config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
                 "num_hidden_layers": 2, "max_position_embeddings": 128}
    pages, _ = engine_setup.size_pool(EngineConfig(**settings), hf_config, torch.device("cpu"), torch.float32)
    assert pages == num_pages
