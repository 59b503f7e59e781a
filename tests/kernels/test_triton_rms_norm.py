"""Triton RMSNorm against the torch reference, in Triton's interpreter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import reference


@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 64)])
@pytest.mark.parametrize(
    ("x_dtype", "w_dtype", "tol"),
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.float16, torch.float16, 2e-3),
        (torch.float16, torch.float32, 2e-3),
    ],
)
def test_rms_norm_matches_reference(
    triton_kernels: SimpleNamespace,
    shape: tuple[int, ...],
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    tol: float,
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen)).to(x_dtype)
    weight = torch.randn(shape[-1], generator=gen).to(w_dtype)
    out = triton_kernels.rms_norm(x, weight, 1e-5)
    expected = reference.rms_norm(x, weight, 1e-5)
    assert out.dtype == expected.dtype and out.shape == x.shape
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_rms_norm_reads_strided_rows(triton_kernels: SimpleNamespace) -> None:
    x = torch.randn(6, 128)[:, :96]  # rows 128 apart, 96 wide
    weight = torch.randn(96)
    torch.testing.assert_close(
        triton_kernels.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)
    )
