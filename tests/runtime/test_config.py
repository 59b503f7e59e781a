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

KV_DTYPE_MESSAGE = "kv_cache_dtype must be one of auto, int8, fp8, got 'int4'"


def test_kv_cache_dtype_accepts_auto_int8_fp8_and_refuses_the_rest(tiny_llama_dir: Path) -> None:
    for name in ("auto", "int8", "fp8"):
        assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(kv_cache_dtype="int4")  # type: ignore[arg-type]
    assert str(info.value) == KV_DTYPE_MESSAGE
    with pytest.raises(InvalidRequestError) as info:
        Engine(model=str(tiny_llama_dir), kv_cache_dtype="int4")
    assert str(info.value) == KV_DTYPE_MESSAGE


@pytest.mark.parametrize(("name", "dtype"), [("int8", torch.int8), ("fp8", torch.float8_e4m3fn)])
def test_an_8bit_kv_cache_stores_codes_and_scales(tiny_llama_dir: Path, name: str, dtype: torch.dtype) -> None:
    engine = Engine(model=str(tiny_llama_dir), kv_cache_dtype=name, num_pages=64, freeze_gc=False)
    try:
        assert engine.kv.k[0].dtype == dtype and engine.kv.k_scale is not None
        assert engine.kv.k_scale[0].shape == engine.kv.k[0].shape[:2]
    finally:
        engine.close()


@pytest.mark.parametrize("command", [["generate", "Hi"], ["serve"]])
def test_the_kv_cache_dtype_flag_gives_the_same_message(
        command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--model", "nowhere", "--kv-cache-dtype", "int4"]) == 2
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


@pytest.mark.parametrize(("kv_dtype", "num_pages"), [
    (torch.float32, 76),
    # int8: 2 x 2 layers x 2 heads x (64 codes + a 4-byte scale) = 544 bytes, so the same
    # 0.15 MiB holds 289 one-token pages: 3.8x fp32's 76.
    (torch.int8, 289),
    (torch.float8_e4m3fn, 289),
])
def test_the_kv_pool_size_counts_an_8bit_pools_real_bytes(
        monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype, num_pages: int) -> None:
    monkeypatch.setattr(engine_setup, "_free_memory_bytes", lambda device: 1 << 20)
    hf_config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
                 "num_hidden_layers": 2, "max_position_embeddings": 128}
    pages, _ = engine_setup.size_pool(EngineConfig(), hf_config, torch.device("cpu"), kv_dtype)
    assert pages == num_pages


def test_fp8_kv_is_refused_on_a_gpu_without_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """An A100 (compute capability 8.0) has no fp8: a typed error that names int8 instead.
    (CUDA itself is faked: only the capability is read.)"""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    cuda = torch.device("cuda")
    with pytest.raises(InvalidRequestError, match="compute capability >= 8.9.*kv_cache_dtype='int8'"):
        engine_setup.resolve_kv_dtype("fp8", cuda, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert engine_setup.resolve_kv_dtype("fp8", cuda, torch.bfloat16) == torch.float8_e4m3fn
    assert engine_setup.resolve_kv_dtype("int8", cuda, torch.bfloat16) == torch.int8
    assert engine_setup.resolve_kv_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert engine_setup.resolve_kv_dtype("fp8", torch.device("cpu"), torch.float32) == torch.float8_e4m3fn


def test_kv_tier_settings_are_checked() -> None:
    assert EngineConfig().kv_tier_dir is None  # off by default
    with pytest.raises(InvalidRequestError, match="kv_tier_max_bytes must be a positive integer"):
        EngineConfig(kv_tier_dir="/tmp", kv_tier_max_bytes=0)
    with pytest.raises(InvalidRequestError, match="not supported with tensor_parallel_size > 1"):
        EngineConfig(kv_tier_dir="/tmp", tensor_parallel_size=2)
