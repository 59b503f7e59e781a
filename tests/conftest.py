"""Fixtures shared by the whole suite: tiny random-weight models built once per session.

The models are small enough to run on the CPU in milliseconds per step, with weights
drawn at a larger std than HF's default so greedy outputs are diverse (a model at the
default init tends to repeat one token). The tokenizer files come from the converted
default model (SmolLM2-135M-Instruct, vocab 49152): ``default_model_dir()`` converts it on
first use (downloading it if needed) and raises if it cannot, so it is never missing here.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

# NOTE: tests/ mirrors the source tree (tests/runtime, tests/kernels, ...) without
# __init__.py files, so pytest's default "prepend" import mode puts tests/ on sys.path to
# import this file, and tests/runtime would then shadow the real `runtime` package as a
# namespace package (the editable install's finder runs after the path scan). A regular
# package anywhere on sys.path beats namespace portions, so the repository root is added.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

# NOTE: Triton reads TRITON_INTERPRET when it is first imported, and some libraries
# (xgrammar) import it early; on a machine without CUDA every Triton kernel in the tests
# runs through the interpreter, so set it before anything can import Triton.
if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "" and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# NOTE: benchmarks run by tests save their results here, not in benchmarks/results/, whose
# files are real runs rendered into docs/benchmarks.md.
os.environ.setdefault("ARBOR_BENCH_RESULTS", tempfile.mkdtemp(prefix="arbor-bench-results-"))

from runtime.model.default_model import default_model_dir  # noqa: E402

TOKENIZER_SOURCE = default_model_dir()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def _save_tiny_model(config: Any, model_cls: Any, out: Path) -> Path:
    import torch

    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                module.weight.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (TOKENIZER_SOURCE / name).is_file():
            shutil.copy(TOKENIZER_SOURCE / name, out / name)
    return out


def _tiny_llama(out: Path, intermediate_size: int, hidden_size: int = 64) -> Path:
    """A 2-layer Llama (hidden 64, GQA 4/2 heads) with random weights, saved to ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    return _save_tiny_model(config, LlamaForCausalLM, out)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF-style directory: 2-layer Llama (hidden 64, GQA 4/2 heads), random weights."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny_llama"), intermediate_size=128)


@pytest.fixture(scope="session")
def tiny_llama_256_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_llama_dir`` with hidden 256 and FFN 512: every linear's width a whole number
    of 256-element superblocks (Q6_K's)."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny_llama_256"), intermediate_size=512, hidden_size=256)


@pytest.fixture(scope="session")
def tiny_llama_mlp40_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_llama_dir`` with an intermediate size of 40, off the 16-row tile grid."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny_llama_mlp40"), intermediate_size=40)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same shape as ``tiny_llama_dir`` as a Qwen2 (q/k/v bias, tied embeddings)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    return _save_tiny_model(config, Qwen2ForCausalLM, tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with Llama 3 rope scaling (factor 8 over 64 original positions), MQA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    return _save_tiny_model(config, LlamaForCausalLM, tmp_path_factory.mktemp("tiny_llama3"))
