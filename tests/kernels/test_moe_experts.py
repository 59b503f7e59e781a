"""Mixture-of-experts ops: routing and grouping against transformers' arithmetic, the C
experts kernel on quantized weights (each instruction-set path) and the Triton grouped
GEMM (interpreter) against the torch reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels import dispatch
from kernels.cpu.moe_experts import CpuMoeExperts
from kernels.reference import moe as M
from kernels.reference import quant as Q

PATH_DEFINES = {"native": (), "avx2": ("ARBOR_QUANT_NO_AVX512",), "portable": ("ARBOR_QUANT_SCALAR",)}


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _experts(num_experts: int, hidden: int, inter: int, seed: int = 0) -> M.ExpertWeights:
    return M.ExpertWeights(_randn(num_experts, 2 * inter, hidden, seed=seed, scale=0.1),
                           _randn(num_experts, hidden, inter, seed=seed + 1, scale=0.1), num_experts)


def _routed(num_tokens: int, num_experts: int, top_k: int, seed: int) -> M.ExpertGroups:
    weights, ids = M.route_topk(_randn(num_tokens, num_experts, seed=seed), top_k, normalize=True)
    return M.group_by_expert(weights, ids, num_experts)


def _loop_over_tokens(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ex: M.ExpertWeights) -> torch.Tensor:
    """The obvious (slow) definition: every token through each of its experts."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate_up, down = ex.expert(int(ids[t, j]))
            assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            gate, up = F.linear(x[t], gate_up).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, down)
    return out


@pytest.mark.parametrize("normalize", [True, False])
def test_route_topk_is_the_softmax_top_k(normalize: bool) -> None:
    logits = _randn(5, 8, seed=1)
    weights, ids = M.route_topk(logits, 2, normalize)
    probs = torch.softmax(logits, -1)
    assert torch.equal(ids, probs.topk(2).indices)
    expected = probs.topk(2).values
    if normalize:  # Mixtral: a softmax over the top-k logits
        expected = torch.softmax(logits.gather(1, ids), -1)
    torch.testing.assert_close(weights, expected)
    with pytest.raises(ValueError, match="top_k"):
        M.route_topk(logits, 9, normalize)


def test_groups_sort_rows_by_expert_then_token() -> None:
    ids = torch.tensor([[2, 0], [0, 3], [2, 3]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    groups = M.group_by_expert(weights, ids, num_experts=4)
    assert groups.token_idx.tolist() == [0, 1, 0, 2, 1, 2]  # expert 0: tokens 0, 1; 2: 0, 2; 3: 1, 2
    assert groups.offsets.tolist() == [0, 2, 2, 4, 6]  # expert 1 owns no rows
    assert groups.weights.tolist() == pytest.approx([0.4, 0.7, 0.6, 0.5, 0.3, 0.5])


@pytest.mark.parametrize("num_tokens", [1, 13])
def test_reference_equals_the_loop_over_tokens(num_tokens: int) -> None:
    ex = _experts(8, 64, 48)
    x = _randn(num_tokens, 64, seed=3)
    weights, ids = M.route_topk(_randn(num_tokens, 8, seed=4), 2, normalize=False)
    out = M.moe_experts(x, M.group_by_expert(weights, ids, 8), ex)
    torch.testing.assert_close(out, _loop_over_tokens(x, weights, ids, ex), atol=1e-5, rtol=1e-5)


def test_expert_weights_check_their_shapes() -> None:
    with pytest.raises(ValueError, match="gate_up must be"):
        M.ExpertWeights(torch.zeros(4, 10, 8), torch.zeros(4, 8, 6), 4)
    with pytest.raises(ValueError, match="both be quantized"):
        M.ExpertWeights(Q.quantize_int8(torch.zeros(4 * 12, 8)), torch.zeros(4, 8, 6), 4)
    with pytest.raises(ValueError, match="tiled gate_up"):
        quantized = Q.tile(Q.quantize_int8(torch.randn(2 * 24, 64)))  # 24 rows per expert
        M.ExpertWeights(quantized, Q.quantize_int8(torch.randn(2 * 64, 12)), 2)


# ---- the C kernel --------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(PATH_DEFINES))
def moe_kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CpuMoeExperts:
    return CpuMoeExperts(tmp_path_factory.getbasetemp() / "moe-paths", PATH_DEFINES[request.param])


QUANTIZE = {
    "int8": lambda w: Q.quantize_int8(w),
    "int4": lambda w: Q.quantize_int4(w),
    "int4-g64": lambda w: Q.quantize_int4(w, blocks_per_group=2),
    "int5": lambda w: Q.quantize_int5(w),  # Q5_0 / Q5_1 experts: 5-bit rows
}


def _quantized(ex: M.ExpertWeights, fmt: str, tiled: bool = False) -> M.ExpertWeights:
    assert isinstance(ex.gate_up, torch.Tensor) and isinstance(ex.down, torch.Tensor)
    gate_up, down = (QUANTIZE[fmt](w.reshape(-1, w.shape[2])) for w in (ex.gate_up, ex.down))
    if tiled:
        gate_up, down = Q.tile(gate_up), Q.tile(down)
    return M.ExpertWeights(gate_up, down, ex.num_experts)


def _int8_activations(x: torch.Tensor, w: torch.Tensor | Q.QuantizedWeight) -> torch.Tensor:
    return M.expert_linear(Q.quantize_activations(x), w)


@pytest.mark.parametrize("fmt", sorted(QUANTIZE))
@pytest.mark.parametrize("num_tokens,hidden,inter", [(1, 64, 48), (19, 96, 80), (7, 40, 24)])
def test_c_kernel_matches_the_reference(moe_kernel: CpuMoeExperts, fmt: str, num_tokens: int, hidden: int,
                                        inter: int) -> None:
    """Equal to the grouped reference with each linear's input rounded to int8 blocks (the
    kernel's activations) up to fp32 summation order; hidden 40 exercises the padding."""
    ex = _quantized(_experts(6, hidden, inter, seed=5), fmt)
    groups = _routed(num_tokens, 6, 2, seed=6)
    x_sorted = _randn(num_tokens, hidden, seed=7).index_select(0, groups.token_idx)
    out = moe_kernel(x_sorted, groups.offsets, ex)
    expected = M.grouped_experts(x_sorted, groups.offsets, ex, linear=_int8_activations)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int5"])
def test_c_kernel_reads_tiled_experts(moe_kernel: CpuMoeExperts, fmt: str) -> None:
    ex = _quantized(_experts(4, 64, 32, seed=8), fmt)
    tiled = _quantized(_experts(4, 64, 32, seed=8), fmt, tiled=True)
    groups = _routed(9, 4, 2, seed=9)
    x_sorted = _randn(9, 64, seed=10).index_select(0, groups.token_idx)
    if not moe_kernel.tiles:
        with pytest.raises(ValueError, match="row layout only"):
            moe_kernel(x_sorted, groups.offsets, tiled)
        return
    torch.testing.assert_close(moe_kernel(x_sorted, groups.offsets, tiled), moe_kernel(x_sorted, groups.offsets, ex),
                               atol=1e-5, rtol=1e-5)


def test_c_kernel_equals_the_quantized_linear_kernel_per_expert(cpu_kernels: SimpleNamespace) -> None:
    """One call for every expert computes the same bits as the layer-by-layer C kernels
    (quant_linear, silu_and_mul) called expert by expert."""
    ex = _quantized(_experts(8, 128, 96, seed=11), "int4")
    groups = _routed(32, 8, 2, seed=12)
    x_sorted = _randn(32, 128, seed=13).index_select(0, groups.token_idx)
    out = cpu_kernels.moe_experts(x_sorted, groups.offsets, ex)
    per_expert = M.grouped_experts(x_sorted, groups.offsets, ex, linear=lambda x, w: cpu_kernels.quant_linear(x, w),
                                   act=lambda g: cpu_kernels.elementwise.silu_and_mul(g))
    assert torch.equal(out, per_expert)


def test_c_kernel_refuses_bad_offsets(cpu_kernels: SimpleNamespace) -> None:
    ex = _quantized(_experts(4, 64, 32), "int8")
    x = _randn(6, 64, seed=1)
    with pytest.raises(ValueError, match="offsets must rise"):
        cpu_kernels.moe_experts(x, torch.tensor([0, 2, 1, 4, 6]), ex)
    with pytest.raises(ValueError, match=r"offsets must be int64 \[5\]"):
        cpu_kernels.moe_experts(x, torch.tensor([0, 6]), ex)
    with pytest.raises(ValueError, match="rows"):
        cpu_kernels.moe_experts(_randn(6, 32, seed=1), torch.tensor([0, 2, 2, 4, 6]), ex)


def test_dispatch_takes_the_c_kernel_for_quantized_experts(cpu_kernels: SimpleNamespace,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    ex = _quantized(_experts(4, 64, 32, seed=14), "int8")
    x = _randn(5, 64, seed=15)
    groups = _routed(5, 4, 2, seed=16)
    rows = cpu_kernels.moe_experts(x.index_select(0, groups.token_idx), groups.offsets, ex)
    assert torch.equal(dispatch.moe_experts(x, groups, ex), M.combine(rows, groups))
    torch.testing.assert_close(dispatch.moe_experts(x, groups, ex), M.moe_experts(x, groups, ex), atol=0.02, rtol=0.02)


def test_dispatch_without_native_kernels_is_the_reference(no_native_cpu_kernels: None) -> None:
    ex = _experts(4, 64, 32, seed=17)
    x = _randn(5, 64, seed=18)
    groups = _routed(5, 4, 2, seed=19)
    assert torch.equal(dispatch.moe_experts(x, groups, ex), M.moe_experts(x, groups, ex))


# ---- the Triton kernel ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (37, 2), (20, 3)])
def test_triton_grouped_experts_match_the_reference(triton_kernels: SimpleNamespace, dtype: torch.dtype,
                                                    tol: float, num_tokens: int, top_k: int) -> None:
    """Rows of 8 experts (some with none, some with more than a block of 16) against the
    grouped reference; 48 intermediate features is not a multiple of the column block."""
    ex = _experts(8, 64, 48, seed=20)
    groups = _routed(num_tokens, 8, top_k, seed=21)
    x_sorted = _randn(num_tokens, 64, seed=22).index_select(0, groups.token_idx)
    assert isinstance(ex.gate_up, torch.Tensor) and isinstance(ex.down, torch.Tensor)
    out = triton_kernels.grouped_experts(x_sorted.to(dtype), groups.offsets, ex.gate_up.to(dtype), ex.down.to(dtype))
    expected = M.grouped_experts(x_sorted, groups.offsets, ex)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_triton_grouped_experts_check_their_arguments(triton_kernels: SimpleNamespace) -> None:
    ex = _experts(4, 32, 16)
    assert isinstance(ex.gate_up, torch.Tensor) and isinstance(ex.down, torch.Tensor)
    x = _randn(3, 32, seed=1)
    with pytest.raises(ValueError, match="down must have shape"):
        triton_kernels.grouped_experts(x, torch.tensor([0, 1, 2, 3, 3]), ex.gate_up, ex.down[:, :, :8])
    with pytest.raises(ValueError, match="offsets must have shape"):
        triton_kernels.grouped_experts(x, torch.tensor([0, 3]), ex.gate_up, ex.down)
