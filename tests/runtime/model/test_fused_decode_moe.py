"""The fused decode step on a mixture of experts (Qwen3-MoE, Mixtral): the experts block
runs inside the step with the experts kernel's arithmetic, so the step equals the
layer-by-layer path within the router's rounding (its logits are a C dot product in the
step, torch's matmul layer by layer; the experts, the combine and the residual adds are
the same serial pieces), and greedy tokens are the same through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels
from runtime import Engine, SamplingParams
from runtime.model.fused_decode import FusedDecode
from runtime.model.loader import load_model
from runtime.model.moe import SparseMoeBlock
from runtime.model.quant import prepare_quantized, quantize_model
from tests.runtime.model.test_fused_decode import Seqs, _prompts, _runners, _slots
from tests.runtime.model.test_moe_families import save_tiny_moe

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _kernels_on(cpu_kernels_enabled: None) -> None:
    """Every test here compares against the layer-by-layer path with the C kernels on."""


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE with a dense layer between two with experts (its ``mlp_only_layers``)."""
    extra = {"mlp_only_layers": [1]} if request.param == "qwen3_moe" else {}
    return save_tiny_moe(request.param, tmp_path_factory.mktemp(request.param), **extra)


def _model(model_dir: Path, fmt: str, tiles: bool) -> torch.nn.Module:
    model = load_model(model_dir, CPU, torch.float32, 1024)
    quantize_model(model, fmt)
    if tiles:
        native = kernels.dispatch._cpu_in_use()
        assert native is not None
        if not native.quant_linear.tiles:
            pytest.skip(f"environment: this CPU's kernels ({native.quant_linear.path}) have no AVX-512 VNNI path")
        prepare_quantized(model)
    return model


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tiles", [False, True], ids=["rows", "tiles"])
def test_fused_moe_steps_match_the_layer_by_layer_path(moe_dir: Path, fmt: str, tiles: bool) -> None:
    """One request at a time: the same greedy tokens, logits equal within the router's
    rounding, the first layer's new K/V (before any experts) bit for bit."""
    model = _model(moe_dir, fmt, tiles)
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks and all(b.quantized is not None for b in blocks)
    eager, fused = _runners(model, 4, torch.float32)
    assert fused.fused is not None
    assert fused.fused.max_batch == 1  # several requests: layer by layer (fused_decode.py)
    for lengths in ([9], [40]):
        seqs = Seqs(_prompts(lengths), 4)
        with torch.inference_mode():
            new = eager.forward(seqs.prefill()).logits.argmax(dim=-1).tolist()
            fused.forward(seqs.prefill())
            for _ in range(4):
                batch = seqs.decode(new)
                want, got = eager.forward(batch), fused.forward(batch)
                torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
                assert got.logits.argmax(dim=-1).tolist() == want.logits.argmax(dim=-1).tolist()
                slots = _slots(seqs)
                assert torch.equal(fused.kv.layer(0)[0][slots], eager.kv.layer(0)[0][slots])
                new = want.logits.argmax(dim=-1).tolist()


def test_engine_greedy_tokens_are_the_same_with_and_without(moe_dir: Path) -> None:
    prompts = _prompts([7, 40, 3, 25])
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for on in (False, True):
        with Engine(model=str(moe_dir), weights="int8", fused_decode=on, speculation=False, page_size=4,
                    num_pages=256) as engine:
            assert isinstance(engine.runner.fused, FusedDecode) == on
            outs[on] = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
            engine.check_integrity()
    assert outs[True] == outs[False]
