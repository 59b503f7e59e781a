"""The mixture-of-experts block against transformers' Qwen3-MoE and Mixtral blocks with the
same weights (batch 1 and a ragged batch of tokens from several requests), its quantized
experts against their own references, and the config and checkpoint readers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import kernels
from kernels import dispatch
from kernels.reference import moe as M
from kernels.reference import quant as Q
from runtime.model.moe import MoEArgs, SparseMoeBlock, hf_experts_state
from runtime.model.quant import Int4, Int8

HIDDEN, INTER, EXPERTS = 64, 48, 8


@pytest.fixture()
def no_native_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path, as in a process that never built the C kernels."""
    monkeypatch.setattr(dispatch, "_cpu", None)


def _config(family: str, **extra: Any) -> Qwen3MoeConfig | MixtralConfig:
    if family == "mixtral":
        return MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                             num_experts_per_tok=2, **extra)
    return Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                          num_experts_per_tok=extra.pop("top_k", 2), **extra)


def _hf_block(cfg: Qwen3MoeConfig | MixtralConfig) -> nn.Module:
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg) if isinstance(cfg, MixtralConfig) else Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    return block.eval()


def _ours(hf: Any, cfg: Qwen3MoeConfig | MixtralConfig) -> SparseMoeBlock:
    block = SparseMoeBlock(HIDDEN, MoEArgs.from_hf_config(cfg.to_dict()))
    state = {"gate.weight": hf.gate.weight, "gate_up_proj": hf.experts.gate_up_proj, "down_proj": hf.experts.down_proj}
    block.load_state_dict({k: v.detach().clone() for k, v in state.items()})
    return block.eval()


FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {},
    "qwen3_moe-norm_topk": {"norm_topk_prob": True},
    "qwen3_moe-top3": {"top_k": 3},
    "mixtral": {},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("num_tokens", [1, 23])
def test_block_equals_transformers(family: str, num_tokens: int, no_native_cpu_kernels: None) -> None:
    """Batch 1, and 23 tokens of three requests of 9, 1 and 13 tokens as one flat ragged
    batch (the block sees only rows): transformers' output up to fp32 rounding (each
    expert's rows go through one F.linear, in another row order, and each token's sum
    runs in expert order)."""
    cfg = _config(family.split("-")[0], **FAMILIES[family])
    hf = _hf_block(cfg)
    ours = _ours(hf, cfg)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x[None])[0]
        out = ours(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_routers_differ_as_the_families_do() -> None:
    """Qwen3-MoE without norm_topk_prob weighs experts by their share of the full softmax;
    Mixtral renormalizes: the same weights give different outputs."""
    qwen, mixtral = (MoEArgs.from_hf_config(_config(f).to_dict()) for f in ("qwen3_moe", "mixtral"))
    assert (qwen.normalize_topk, mixtral.normalize_topk) == (False, True)
    assert MoEArgs.from_hf_config(_config("qwen3_moe", norm_topk_prob=True).to_dict()).normalize_topk


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("num_tokens", [1, 23])
def test_quantized_block_matches_its_references(fmt: str, num_tokens: int, cpu_kernels_enabled: None) -> None:
    """With the C kernels: the quantized experts equal the grouped reference over the same
    quantized weights with int8-rounded activations (the kernel's arithmetic), and stay
    near the fp32 block; the tiled layout gives the same output."""
    cfg = _config("qwen3_moe", norm_topk_prob=True)
    hf = _hf_block(cfg)
    fp32 = _ours(hf, cfg)
    block = _ours(hf, cfg)
    block.quantize({"int8": Int8, "int4": Int4}[fmt].linear)
    assert block.quantized is not None and block.gate_up_proj.numel() == 0
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = block(x)
        weights, ids = M.route_topk(block.gate(x), 2, True)
        groups = M.group_by_expert(weights, ids, EXPERTS)
        rows = M.grouped_experts(x.index_select(0, groups.token_idx), groups.offsets, block.quantized,
                                 linear=lambda a, w: M.expert_linear(Q.quantize_activations(a), w))
        torch.testing.assert_close(out, M.combine(rows, groups), atol=1e-5, rtol=1e-5)
        spec = M.moe_experts(x, groups, block.quantized)  # fp32 activations, dequantized weights
        assert ((out - spec).norm() / spec.norm()).item() < 0.02
        assert ((out - fp32(x)).norm() / fp32(x).norm()).item() < (0.02 if fmt == "int8" else 0.2)
        block.convert_quantized(kernels.prepare_quantized)
        assert isinstance(block.quantized.gate_up, Q.QuantizedWeight)
        assert block.quantized.gate_up.tiled == kernels.reads_tiles()  # 96 and 64 rows per expert: whole tiles
        torch.testing.assert_close(block(x), out, atol=1e-5, rtol=1e-5)


def test_convert_keeps_the_row_layout_for_experts_of_partial_tiles() -> None:
    args = MoEArgs(num_experts=2, top_k=1, intermediate_size=12, normalize_topk=True)
    block = SparseMoeBlock(32, args)
    nn.init.normal_(block.gate_up_proj)
    nn.init.normal_(block.down_proj)
    block.quantize(Int8.linear)  # 24 gate_up rows per expert: not whole tiles
    block.convert_quantized(Q.tile)
    assert block.quantized is not None
    gate_up, down = block.quantized.gate_up, block.quantized.down
    assert isinstance(gate_up, Q.QuantizedWeight) and isinstance(down, Q.QuantizedWeight)
    assert not gate_up.tiled and down.tiled  # 32 down rows per expert


def test_config_reader_refuses_what_it_does_not_implement() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEArgs.from_hf_config({**_config("mixtral").to_dict(), "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="silu"):
        MoEArgs.from_hf_config({**_config("mixtral").to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="shared experts"):
        MoEArgs.from_hf_config({**_config("qwen3_moe").to_dict(), "shared_expert_intermediate_size": 64})
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        MoEArgs.from_hf_config({"model_type": "llama"})


def test_qwen3_moe_sparse_layers() -> None:
    args = MoEArgs.from_hf_config({**_config("qwen3_moe").to_dict(), "decoder_sparse_step": 2,
                                   "mlp_only_layers": [3]})
    assert [args.has_experts(i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.mark.parametrize("layout", ["per-expert", "mixtral", "stacked"])
def test_checkpoint_experts_load_stacked(layout: str) -> None:
    gen = torch.Generator().manual_seed(3)
    gate = [torch.randn(INTER, HIDDEN, generator=gen) for _ in range(2)]
    up = [torch.randn(INTER, HIDDEN, generator=gen) for _ in range(2)]
    down = [torch.randn(HIDDEN, INTER, generator=gen) for _ in range(2)]
    src = "model.layers.0.mlp."
    hf = {src + "gate.weight": torch.randn(2, HIDDEN, generator=gen)}
    names = ("w1", "w3", "w2") if layout == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    if layout == "stacked":
        hf[src + "experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        hf[src + "experts.down_proj"] = torch.stack(down)
    else:
        for e in range(2):
            for name, w in zip(names, (gate[e], up[e], down[e]), strict=True):
                hf[f"{src}experts.{e}.{name}.weight"] = w
    state = hf_experts_state(hf.__getitem__, hf.__contains__, src, 2)
    assert torch.equal(state["gate_up_proj"][1], torch.cat([gate[1], up[1]]))
    assert torch.equal(state["down_proj"][0], down[0])
    assert torch.equal(state["gate.weight"], hf[src + "gate.weight"])
