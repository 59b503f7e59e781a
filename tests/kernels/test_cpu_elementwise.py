"""The native CPU elementwise kernels (``kernels/cpu/elementwise.c``) against the torch
reference: RMSNorm with and without the residual add, SiLU-and-mul, rotary embedding on
the strided q/k view of a fused qkv row; and the fallbacks they decline."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import dispatch, reference
from kernels.cpu import CpuElementwise, CpuKernels


@pytest.fixture()
def native(cpu_kernels: CpuKernels) -> CpuElementwise:
    return cpu_kernels.elementwise


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 spreads over threads
def test_rms_norm_and_add_rms_norm(native: CpuElementwise, rows: int) -> None:
    x, residual, weight = _randn(rows, 576, seed=1), _randn(rows, 576, seed=2, scale=5), _randn(576, seed=3)
    out = native.rms_norm(x, weight, 1e-5)
    assert out is not None
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-5), atol=1e-5, rtol=1e-5)
    want_norm, want_sum = reference.add_rms_norm(x, residual, weight, 1e-5)
    stream = residual.clone()
    done = native.add_rms_norm(x, stream, weight, 1e-5)
    assert done is not None
    torch.testing.assert_close(done[0], want_norm, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(done[1], want_sum, atol=0, rtol=0)  # one fp32 add: exact
    assert done[1].data_ptr() == stream.data_ptr()  # the residual stream is updated in place


def test_silu_and_mul(native: CpuElementwise) -> None:
    gate_up = _randn(33, 2 * 1536, seed=4, scale=6)  # far into both tails of the sigmoid
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    out = native.silu_and_mul(gate_up)
    assert out is not None and out.shape == (33, 1536)
    torch.testing.assert_close(out, reference.silu_and_mul(gate_up), atol=1e-5, rtol=1e-5)


def test_rotary_in_place_on_the_fused_qkv_view(native: CpuElementwise) -> None:
    tokens, q_heads, kv_heads, dim = 19, 9, 3, 64
    qkv = _randn(tokens, (q_heads + 2 * kv_heads) * dim, seed=5)
    angles = _randn(tokens, 1, dim // 2, seed=6, scale=3)
    cos, sin = angles.cos(), angles.sin()
    want = qkv.clone()
    reference.apply_rotary(want[:, : (q_heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
    qk = qkv[:, : (q_heads + kv_heads) * dim].view(tokens, -1, dim)
    assert native.apply_rotary(qk, cos, sin)
    torch.testing.assert_close(qkv, want, atol=1e-6, rtol=1e-6)  # v untouched, q and k rotated
    assert torch.equal(qkv[:, (q_heads + kv_heads) * dim :], want[:, (q_heads + kv_heads) * dim :])


def test_declined_inputs_fall_back_to_the_reference(
    cpu_kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dispatch, "_cpu", cpu_kernels)
    native = cpu_kernels.elementwise
    x = _randn(4, 64, seed=7).bfloat16()
    assert native.rms_norm(x, torch.ones(64), 1e-5) is None
    torch.testing.assert_close(kernels.rms_norm(x, torch.ones(64), 1e-5),
                               reference.rms_norm(x, torch.ones(64), 1e-5))
    strided = _randn(4, 128, seed=8)[:, ::2]  # not contiguous
    assert native.silu_and_mul(strided) is None
    torch.testing.assert_close(kernels.silu_and_mul(strided), reference.silu_and_mul(strided))
    heads_apart = _randn(3, 4, 2, 8, seed=9)[:, :, 0]  # [T, H, D] with heads 16 floats apart
    cos, sin = torch.ones(3, 1, 4), torch.zeros(3, 1, 4)
    assert not native.apply_rotary(heads_apart, cos, sin)
    before = heads_apart.clone()
    kernels.apply_rotary(heads_apart, cos, sin)  # identity rotation through the reference
    torch.testing.assert_close(heads_apart, before)


def test_mismatched_shapes_are_declined_not_read_past(native: CpuElementwise) -> None:
    x = _randn(4, 64, seed=10)
    assert native.rms_norm(x, torch.ones(32), 1e-5) is None
    assert native.add_rms_norm(x, x.clone(), torch.ones(65), 1e-5) is None
    assert native.add_rms_norm(x, _randn(4, 32, seed=11), torch.ones(64), 1e-5) is None
    assert native.silu_and_mul(_randn(4, 63, seed=12)) is None
    with pytest.raises(RuntimeError):  # the reference is what reports the mismatch
        kernels.rms_norm(x, torch.ones(32), 1e-5)
