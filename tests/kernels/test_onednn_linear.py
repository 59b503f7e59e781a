"""oneDNN-prepacked linears: same results as ``F.linear``, any number of rows, clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="environment: this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 3, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    packed = onednn.PackedLinear.from_linear(linear)
    x = torch.randn(rows, 96)
    want = F.linear(x, linear.weight, linear.bias)
    got = packed(x)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_leading_dims_and_non_contiguous_input() -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 24)
    packed = onednn.PackedLinear(weight)
    x = torch.randn(24, 3, 5).permute(1, 2, 0)  # [3, 5, 24], not contiguous
    torch.testing.assert_close(packed(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_weight_is_copied_at_pack_time() -> None:
    weight = torch.randn(8, 16)
    packed = onednn.PackedLinear(weight)
    x = torch.randn(2, 16)
    before = packed(x)
    weight.zero_()
    torch.testing.assert_close(packed(x), before)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="fp32"):
        onednn.PackedLinear(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D"):
        onednn.PackedLinear(torch.randn(4))
    with pytest.raises(TypeError, match="nn.Linear"):
        onednn.PackedLinear.from_linear(nn.Identity())
    with pytest.raises(ValueError, match="input features"):
        onednn.PackedLinear(torch.randn(4, 8))(torch.randn(2, 5))
