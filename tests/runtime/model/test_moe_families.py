"""Qwen3-MoE and Mixtral end to end: an engine on a tiny random model of each family gives
transformers' greedy tokens over 32 steps and its log-probabilities, from the HF directory
and from a GGUF file written with the ``gguf`` package from the same weights; quantized
experts run; what is not supported is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kernels import QuantizedWeight
from runtime import Engine, SamplingParams
from runtime.errors import ModelLoadError
from runtime.model.gguf_file import GGUFFile
from runtime.model.moe import SparseMoeBlock
from tests.conftest import TOKENIZER_FILES, TOKENIZER_SOURCE
from tests.runtime.model.family_models import write_family_gguf
from tests.runtime.test_engine_reference import check_against_hf, load_hf

VOCAB = 49152


def _config(family: str, **extra: Any) -> Any:
    from transformers import MixtralConfig, Qwen3MoeConfig

    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                                  eos_token_id=2, tie_word_embeddings=False, rms_norm_eps=1e-5)
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                             sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    # top-3 with renormalised weights (llama.cpp's qwen3moe always renormalizes)
    return Qwen3MoeConfig(**common, head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                          num_experts_per_tok=3, norm_topk_prob=True, **extra)


def save_tiny_moe(family: str, out: Path, **extra: Any) -> Path:
    """A tiny random model of ``family`` saved as transformers saves it, with the default
    model's tokenizer. Weights drawn wider than HF's init (diverse greedy tokens); the
    router wider still, so no two experts' probabilities nearly tie."""
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = (MixtralForCausalLM if family == "mixtral" else Qwen3MoeForCausalLM)(_config(family, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if name.endswith("mlp.gate.weight") else 0.1)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (TOKENIZER_SOURCE / name).is_file():
            shutil.copy(TOKENIZER_SOURCE / name, out / name)
    return out


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_moe(request.param, tmp_path_factory.mktemp(request.param))


def _prompts() -> list[list[int]]:
    rng = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=rng).tolist() for n in (1, 9, 40)]


def test_hf_dir_matches_transformers(moe_dir: Path) -> None:
    """Greedy tokens over 32 steps and log-probabilities: one batch of three prompts
    (a ragged batch for the experts) against transformers, each prompt alone."""
    with Engine(model=str(moe_dir), page_size=4, num_pages=512) as engine:
        blocks = [layer.mlp for layer in engine.model.layers]
        assert all(isinstance(b, SparseMoeBlock) for b in blocks)
        check_against_hf(engine, load_hf(moe_dir), _prompts())


def test_qwen3_moe_dense_layers_match_transformers(tmp_path: Path) -> None:
    """Qwen3-MoE's ``mlp_only_layers`` keep a dense MLP (of ``intermediate_size``)."""
    model_dir = save_tiny_moe("qwen3_moe", tmp_path, mlp_only_layers=[1])
    with Engine(model=str(model_dir), page_size=4, num_pages=512) as engine:
        kinds = [type(layer.mlp).__name__ for layer in engine.model.layers]
        assert kinds == ["SparseMoeBlock", "MLP", "SparseMoeBlock"]
        check_against_hf(engine, load_hf(model_dir), _prompts()[:2])


def _prompt_logprobs(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=True)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return torch.tensor([lp for o in outs for lp in o.prompt_logprobs[1:]])


@pytest.mark.parametrize(("weights", "bound"), [("int8", 0.1), ("int4", 0.6)])
def test_quantized_experts_stay_near_fp32(moe_dir: Path, weights: str, bound: float) -> None:
    """int8 / int4 experts (the C kernel) give the fp32 model's prompt log-probabilities
    within the formats' rounding (mean absolute difference over every prompt position)."""
    prompts = _prompts()
    with Engine(model=str(moe_dir), page_size=4, num_pages=512) as fp32:
        want = _prompt_logprobs(fp32, prompts)
    with Engine(model=str(moe_dir), page_size=4, num_pages=512, weights=weights) as quant:
        block = next(layer.mlp for layer in quant.model.layers if isinstance(layer.mlp, SparseMoeBlock))
        assert block.quantized is not None
        got = _prompt_logprobs(quant, prompts)
    diff = (got - want).abs().mean().item()
    print(f"{weights}: mean |d logprob| = {diff:.4f}")
    assert 0 < diff < bound


def test_tensor_parallel_experts_are_refused(moe_dir: Path) -> None:
    with pytest.raises((ModelLoadError, ValueError), match="experts"):
        Engine(model=str(moe_dir), tensor_parallel_size=2, num_pages=64)


# ---- GGUF ------------------------------------------------------------------------------------
def write_moe_gguf(model_dir: Path, path: Path, qtype: str = "F32", drop: tuple[str, ...] = (),
                   **options: Any) -> Path:
    """``model_dir``'s weights as llama.cpp's converter lays them out: Qwen3-MoE as
    ``qwen3moe``, Mixtral as ``llama`` with experts (its q / k rows permuted), experts as
    3-D ``ffn_{gate,up,down}_exps`` tensors beside the router ``ffn_gate_inp``; ``options``:
    ``write_family_gguf``'s ``metadata`` / ``chat_template``."""
    from runtime.model.default_model import default_gguf_file

    cfg = json.loads((model_dir / "config.json").read_text())
    mixtral = cfg["model_type"] == "mixtral"
    num_experts = cfg.get("num_local_experts") or cfg["num_experts"]

    def experts(w: Any, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        w.add_expert_count(num_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if not mixtral:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        out = {}
        for i in range(cfg["num_hidden_layers"]):
            src, pre = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}.", f"blk.{i}."
            out[pre + "ffn_gate_inp.weight"] = hf[src + "gate.weight"]
            for gguf_name, name in zip(("gate", "up", "down"), names, strict=True):
                out[pre + f"ffn_{gguf_name}_exps.weight"] = np.stack(
                    [hf[f"{src}experts.{e}.{name}.weight"] for e in range(num_experts)])
        return out

    source = GGUFFile(default_gguf_file())
    try:
        return write_family_gguf(model_dir, path, "llama" if mixtral else "qwen3moe", source, qtype,
                                 permute_qk=mixtral, drop=drop, extra=experts, **options)
    finally:
        source.close()


def test_gguf_file_matches_transformers(moe_dir: Path, tmp_path: Path) -> None:
    """The same weights from a GGUF file (F32 tensors, read natively): transformers' tokens
    and log-probabilities on the HF directory."""
    path = write_moe_gguf(moe_dir, tmp_path / "moe.gguf")
    with Engine(model=str(path), weights="fp32", page_size=4, num_pages=512) as engine:
        check_against_hf(engine, load_hf(moe_dir), _prompts())


def test_gguf_blocks_load_as_quantized_experts(moe_dir: Path, tmp_path: Path) -> None:
    """A Q8_0 file keeps its blocks (``weights="auto"``): the experts are the file's codes,
    and the prompt log-probabilities stay near the fp32 model's."""
    path = write_moe_gguf(moe_dir, tmp_path / "moe-q8.gguf", "Q8_0")
    prompts = _prompts()
    with Engine(model=str(moe_dir), page_size=4, num_pages=512) as fp32:
        want = _prompt_logprobs(fp32, prompts)
    with Engine(model=str(path), page_size=4, num_pages=512) as native:
        block = next(layer.mlp for layer in native.model.layers if isinstance(layer.mlp, SparseMoeBlock))
        assert block.quantized is not None and block.quantized.num_experts == 8
        assert isinstance(block.quantized.gate_up, QuantizedWeight) and block.quantized.gate_up.bits == 8
        got = _prompt_logprobs(native, prompts)
    assert 0 < (got - want).abs().mean().item() < 0.1


def test_gguf_missing_expert_tensor_is_named(moe_dir: Path, tmp_path: Path) -> None:
    path = write_moe_gguf(moe_dir, tmp_path / "broken.gguf", drop=("blk.2.ffn_up_exps.weight",))
    with pytest.raises(ModelLoadError, match="blk.2.ffn_up_exps.weight"):
        Engine(model=str(path), num_pages=64)
