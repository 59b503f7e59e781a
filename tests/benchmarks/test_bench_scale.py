"""benchmarks/bench_scale.py's random files: the Q4_K_M type rule and sane random blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from benchmarks.bench_scale import BLOCK_WRITERS, tensor_type
from kernels.reference.quant import dequantize, from_ggml_blocks


def test_q4_k_m_puts_q6_k_where_llama_quantize_does() -> None:
    """Head in Q6_K; attn_v and ffn_down in Q6_K for the first and last eighth of the layers
    and every third between; everything else Q4_K. Other file types are uniform."""
    more_bits = [i for i in range(16) if tensor_type(f"blk.{i}.ffn_down.weight", "Q4_K_M", 16) == "Q6_K"]
    assert more_bits == [0, 1, 4, 7, 10, 13, 14, 15]
    assert tensor_type("blk.4.attn_v.weight", "Q4_K_M", 16) == "Q6_K"
    assert tensor_type("blk.5.attn_v.weight", "Q4_K_M", 16) == "Q4_K"
    assert tensor_type("blk.0.attn_q.weight", "Q4_K_M", 16) == "Q4_K"
    assert tensor_type("output.weight", "Q4_K_M", 16) == "Q6_K"
    assert tensor_type("token_embd.weight", "Q4_K_M", 16) == "Q4_K"
    assert tensor_type("output.weight", "Q8_0", 16) == "Q8_0"


@pytest.mark.parametrize("kind", sorted(BLOCK_WRITERS))
def test_random_blocks_are_sane_weights(kind: str) -> None:
    """gguf reads them as weights of a trained model's size (|w| < 0.5, not all zero), and
    our loader takes them bit for bit."""
    raw = BLOCK_WRITERS[kind](32, 512, np.random.default_rng(0))
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    assert values.shape == (32, 512) and np.isfinite(values).all()
    assert 0 < np.abs(values).max() < 0.5 and np.abs(values).mean() > 1e-4
    ours = dequantize(from_ggml_blocks(torch.from_numpy(raw), kind, 512))
    torch.testing.assert_close(ours, torch.from_numpy(values), atol=1e-3 * float(np.abs(values).max()), rtol=0)
