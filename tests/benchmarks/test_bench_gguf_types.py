"""benchmarks/bench_gguf_types.py's reading of llama.cpp's output and its table, and
bench_q5_layouts' layouts (the same weight in each)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_gguf_types import _batched_tg, _rows
from benchmarks.bench_q5_layouts import layouts
from kernels.reference.quant import dequantize

BATCHED = """
main: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_gpu_layers = -1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |     64 |    8 |    640 |    0.105 |  1219.05 |    1.920 |   266.67 |    2.025 |   316.05 |

llama_perf_context_print:        load time =      95.74 ms
"""


def test_the_batched_decode_rate_is_llama_batched_benchs_s_tg() -> None:
    assert _batched_tg(BATCHED) == 266.67
    with pytest.raises(RuntimeError, match="no llama-batched-bench table"):
        _batched_tg("error: failed to load model")


def test_rows_are_medians_per_type_and_streams_with_ratios_to_llama_cpp() -> None:
    runs = {("Q5_0", "arbor after"): [{"decode_1": 100.0, "decode_8": 400.0}, {"decode_1": 120.0, "decode_8": 500.0},
                                      {"decode_1": 90.0, "decode_8": 450.0}],
            ("Q5_0", "llama.cpp"): [{"decode_1": 80.0, "decode_8": 200.0}] * 3}
    rows = _rows(runs, ["Q5_0"], ["arbor after", "llama.cpp"])
    assert rows == [{"type": "Q5_0", "streams": 1, "arbor after tok/s": 100.0, "llama.cpp tok/s": 80.0,
                     "arbor after / llama.cpp": 1.25},
                    {"type": "Q5_0", "streams": 8, "arbor after tok/s": 450.0, "llama.cpp tok/s": 200.0,
                     "arbor after / llama.cpp": 2.25}]


def test_the_layouts_compared_hold_one_weight() -> None:
    """The 5-bit tiles, rows and the 8-bit tiles are the same 5-bit values (the 4-bit floor
    is another rounding, of the same shape)."""
    held = layouts(torch.randn(32, 128) * 0.05)
    five = dequantize(held["5-bit rows"])
    assert torch.equal(dequantize(held["5-bit tiles"]), five)
    assert torch.equal(dequantize(held["8-bit tiles (Q5 before)"]), five)
    assert [w.bits for w in held.values()] == [5, 5, 8, 4]
    assert [w.tiled for w in held.values()] == [True, False, True, True]
