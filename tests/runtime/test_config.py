"""Engine settings: each refused value fails at construction with a message naming what is
accepted, the same from ``Engine(...)``, ``EngineConfig(...)`` and the ``arbor`` flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime import Engine, InvalidRequestError
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
