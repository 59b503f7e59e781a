"""Rotary embeddings against the formulas written out directly (RoFormer, Llama 3.1)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import kernels
from runtime.model.rope import (
    RotaryEmbedding,
    rope_attention_factor,
    rope_context_problem,
    rope_inv_freq,
)


def direct_inv_freq(head_dim: int, theta: float) -> list[float]:
    """RoFormer: frequency i of a head is ``theta ** (-2i / head_dim)``."""
    return [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]


def llama3_scaled(freqs: list[float], factor: float, low: float, high: float, old_len: float) -> list[float]:
    """Meta's ``apply_scaling`` (Llama 3.1 reference code), one frequency at a time."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def test_default_frequencies_follow_the_formula() -> None:
    got = rope_inv_freq(8, {"rope_theta": 10000.0})
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([1.0, 0.1, 0.01, 0.001], rel=1e-6)
    assert rope_inv_freq(64, {}).tolist() == pytest.approx(direct_inv_freq(64, 10000.0), rel=1e-6)


def test_linear_scaling_divides_every_frequency() -> None:
    got = rope_inv_freq(16, {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0})
    assert got.tolist() == pytest.approx([f / 4 for f in direct_inv_freq(16, 500.0)], rel=1e-6)


def test_llama3_scaling_matches_the_reference_code_in_all_three_bands() -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    freqs = direct_inv_freq(64, 500000.0)
    wavelens = [2 * math.pi / f for f in freqs]
    # the case is chosen so that some frequencies are kept, some divided, some blended
    assert min(wavelens) < 16 and any(16 <= w <= 64 for w in wavelens) and max(wavelens) > 64
    expected = llama3_scaled(freqs, factor=8.0, low=1.0, high=4.0, old_len=64.0)
    assert rope_inv_freq(64, rope).tolist() == pytest.approx(expected, rel=1e-6)


def test_unknown_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported rope_type 'proportional'"):
        rope_inv_freq(64, {"rope_type": "proportional", "factor": 2.0})


def _hf_rope(rope: dict[str, Any], seq_len: int | None = None) -> tuple[list[float], float]:
    """transformers' own inverse frequencies and attention scale for ``rope`` (head_dim 32)."""
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen2Config(hidden_size=128, num_attention_heads=4, head_dim=32, max_position_embeddings=4096,
                         rope_parameters=dict(rope))
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None, seq_len=seq_len)
    return inv_freq.tolist(), float(scale)


@pytest.mark.parametrize("extra", [
    {},
    {"beta_fast": 16.0, "beta_slow": 2.0},
    {"mscale": 0.707, "mscale_all_dim": 1.0},
    {"attention_factor": 1.25},
    {"truncate": False},
])
def test_yarn_is_transformers_yarn(extra: dict[str, Any]) -> None:
    rope = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "max_position_embeddings": 4096, **extra}
    want, scale = _hf_rope(rope)
    assert rope_inv_freq(32, rope).tolist() == pytest.approx(want, rel=1e-6)
    assert rope_attention_factor(rope) == pytest.approx(scale, rel=1e-9)
    assert scale != 1.0


@pytest.mark.parametrize("max_positions", [512, 1024, 1025, 4096])
def test_longrope_picks_its_long_factors_past_the_original_context(max_positions: int) -> None:
    """As llama.cpp: by the longest sequence served (transformers: by the current one)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 1024,
            "max_position_embeddings": 4096, "short_factor": [1.0 + i / 32 for i in range(16)],
            "long_factor": [1.0 + i for i in range(16)]}
    want, scale = _hf_rope(rope, seq_len=max_positions)
    assert rope_inv_freq(32, rope, max_positions).tolist() == pytest.approx(want, rel=1e-6)
    assert rope_attention_factor(rope) == pytest.approx(scale, rel=1e-9) and scale > 1.0
    assert rope_inv_freq(32, rope).tolist() == pytest.approx(_hf_rope(rope)[0], rel=1e-6)  # unknown: short


def test_longrope_factors_must_cover_every_frequency() -> None:
    rope = {"rope_type": "longrope", "original_max_position_embeddings": 16, "short_factor": [1.0] * 3,
            "long_factor": [1.0] * 3}
    with pytest.raises(ValueError, match="3 rope frequency factors for 16 frequencies"):
        rope_inv_freq(32, rope)


def test_table_holds_cos_and_sin_of_position_times_frequency() -> None:
    rope = RotaryEmbedding(head_dim=4, max_positions=10, rope={"rope_theta": 10000.0})
    cos, sin = rope.lookup(torch.tensor([3, 0, 9]))
    assert cos.shape == (3, 1, 2) and sin.shape == (3, 1, 2)
    for row, pos in enumerate([3, 0, 9]):
        assert cos[row, 0].tolist() == pytest.approx([math.cos(pos), math.cos(pos / 100)], abs=1e-6)
        assert sin[row, 0].tolist() == pytest.approx([math.sin(pos), math.sin(pos / 100)], abs=1e-6)


def test_rotation_pairs_the_halves_of_a_head() -> None:
    """HF's "rotate half" layout: element i pairs with element i + D/2."""
    rope = RotaryEmbedding(head_dim=4, max_positions=8, rope={"rope_theta": 10000.0})
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # [T=1, H=1, D=4]
    kernels.apply_rotary(x, *rope.lookup(torch.tensor([5])))
    a, b = 5.0, 5.0 / 100  # angles of the two pairs (x0, x2) and (x1, x3)
    expected = [1 * math.cos(a) - 3 * math.sin(a), 2 * math.cos(b) - 4 * math.sin(b),
                3 * math.cos(a) + 1 * math.sin(a), 4 * math.cos(b) + 2 * math.sin(b)]
    assert x[0, 0].tolist() == pytest.approx(expected, abs=1e-6)


def test_attention_scores_depend_only_on_the_distance() -> None:
    rope = RotaryEmbedding(head_dim=16, max_positions=64, rope={"rope_theta": 10000.0})
    gen = torch.Generator().manual_seed(0)
    q0, k0 = torch.randn(1, 1, 16, generator=gen), torch.randn(1, 1, 16, generator=gen)

    def score(q_pos: int, k_pos: int) -> float:
        q, k = q0.clone(), k0.clone()
        kernels.apply_rotary(q, *rope.lookup(torch.tensor([q_pos])))
        kernels.apply_rotary(k, *rope.lookup(torch.tensor([k_pos])))
        return float((q * k).sum())

    assert score(7, 3) == pytest.approx(score(40, 36), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 2), abs=1e-3)


def test_dynamic_ntk_is_the_plain_rope_within_the_context_and_refused_past_it() -> None:
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0, "max_position_embeddings": 4096}
    assert rope_inv_freq(32, rope).tolist() == pytest.approx(_hf_rope(rope)[0], rel=1e-6)
    assert rope_context_problem(rope, 4096) is None
    RotaryEmbedding(32, 4096, rope)
    with pytest.raises(ValueError, match=r"rope_type 'dynamic' .* up to the model's max_position_embeddings \(4096"):
        RotaryEmbedding(32, 4097, rope)
