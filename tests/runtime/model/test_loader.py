"""Finding and loading a model: which paths are accepted, the fused weights, and the
``ModelLoadError`` message for each kind of broken model directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.errors import ModelLoadError
from runtime.model.default_model import default_model_dir
from runtime.model.loader import load_model, load_tokenizer, read_config, resolve_model_dir

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer HF Llama with a 100-token vocabulary (weights only, no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    out = tmp_path_factory.mktemp("small_llama")
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture()
def broken_dir(small_dir: Path, tmp_path: Path) -> Path:
    """A copy of ``small_dir`` for a test to break."""
    return Path(shutil.copytree(small_dir, tmp_path / "model"))


def test_default_and_hf_directories_resolve(small_dir: Path) -> None:
    assert resolve_model_dir(None) == resolve_model_dir("default") == default_model_dir()
    assert resolve_model_dir(str(small_dir)) == small_dir


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "nowhere", "model path does not exist"),
        (lambda d: d / "config.json", "is a file but not a .gguf file"),
        (lambda d: (d / "config.json").unlink() or d, "has no config.json"),
        (lambda d: (d / "model.safetensors").unlink() or d, r"has no \*\.safetensors weights"),
    ],
    ids=["missing", "not-gguf", "no-config", "no-weights"],
)
def test_paths_that_are_not_models_are_refused(broken_dir: Path, make, message: str) -> None:  # type: ignore[no-untyped-def]
    path = make(broken_dir)
    with pytest.raises(ModelLoadError, match=message):
        resolve_model_dir(str(path))


def test_weights_are_fused_and_cast(small_dir: Path) -> None:
    hf = load_file(str(small_dir / "model.safetensors"))
    model = load_model(small_dir, CPU, torch.bfloat16, max_positions=48)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp  # type: ignore[union-attr]
    qkv = torch.cat([hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert attn.qkv_proj.weight.shape == (32 + 2 * 16, 32)
    assert torch.equal(attn.qkv_proj.weight, qkv.bfloat16())
    gate_up = torch.cat([hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]])
    assert torch.equal(mlp.gate_up_proj.weight, gate_up.bfloat16())
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"].bfloat16())  # type: ignore[union-attr]
    assert model.rope.cos.shape == (48, 4) and not model.rope.cos.is_meta
    assert model.rope.cos[0].tolist() == [1.0] * 4  # position 0: no rotation


def test_missing_weight_is_named(broken_dir: Path) -> None:
    weights = load_file(str(broken_dir / "model.safetensors"))
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, str(broken_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="weight 'model.layers.0.mlp.up_proj.weight' missing"):
        load_model(broken_dir, CPU, torch.float32, max_positions=16)


def test_unreadable_weights_config_and_architecture_are_reported(broken_dir: Path) -> None:
    (broken_dir / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="cannot read weights .*model.safetensors"):
        load_model(broken_dir, CPU, torch.float32, max_positions=16)
    config = read_config(broken_dir)
    (broken_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported model config in .*unsupported model_type 'gpt2'"):
        load_model(broken_dir, CPU, torch.float32, max_positions=16)
    (broken_dir / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "proportional", "factor": 2.0}}))
    with pytest.raises(ModelLoadError, match="unsupported model config in .*unsupported rope_type 'proportional'"):
        load_model(broken_dir, CPU, torch.float32, max_positions=16)
    (broken_dir / "config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="cannot read .*config.json"):
        read_config(broken_dir)


def test_tokenizer_comes_from_the_model_directory(tiny_llama_dir: Path, small_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)  # the SmolLM2 tokenizer files
    assert tokenizer.decode(tokenizer("Hello world")["input_ids"]) == "Hello world"
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_tokenizer(small_dir)
