"""Fixtures for constrained-decoding tests: the default tokenizer and the backends."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
if sys.path[:1] != [str(ROOT)]:
    sys.path.insert(0, str(ROOT))
for _name in ("grammars", "runtime"):  # drop namespace-package shadows (see tests/grammars)
    if _name in sys.modules and getattr(sys.modules[_name], "__file__", None) is None:
        del sys.modules[_name]

from runtime.constrained import GrammarBackend, create_backend  # noqa: E402
from runtime.model.default_model import default_model_dir  # noqa: E402

TOKENIZER_DIR = default_model_dir()
BACKEND_NAMES = ["llguidance", "xgrammar", "outlines"]
EOS = 2  # <|im_end|>


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


_BACKENDS: dict[str, GrammarBackend] = {}


@pytest.fixture(scope="session")
def get_backend(tokenizer: Any) -> Any:
    """``get_backend(name)``: the backend for the default tokenizer, built once per session."""

    def get(name: str) -> GrammarBackend:
        if name not in _BACKENDS:
            _BACKENDS[name] = create_backend(name, tokenizer, len(tokenizer))
        return _BACKENDS[name]

    return get


def encode(tokenizer: Any, text: str) -> list[int]:
    """The canonical tokenization of ``text`` (no BOS/EOS)."""
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids
