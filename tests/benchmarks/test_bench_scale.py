"""benchmarks/bench_scale.py: its random files (the Q4_K_M type rule, sane random blocks, the
streamed writer, the MoE layout) and its table of figures against llama.cpp."""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from benchmarks.bench_scale import (
    BLOCK_WRITERS,
    SHAPES,
    Shape,
    Workload,
    metric_rows,
    model_tensors,
    tensor_type,
    workload_for,
    write_model,
)
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


def test_moe_shape_has_stacked_experts_in_llama_cpp_layout() -> None:
    tensors = model_tensors(SHAPES["moe"])
    moe = SHAPES["moe"]
    assert tensors["blk.0.ffn_gate_inp.weight"] == (8, moe.hidden)
    assert tensors["blk.7.ffn_gate_exps.weight"] == (8, moe.ffn, moe.hidden)
    assert tensors["blk.7.ffn_down_exps.weight"] == (8, moe.hidden, moe.ffn)
    assert not any(name.endswith("ffn_gate.weight") for name in tensors)
    dense = model_tensors(SHAPES["8b"])
    assert dense["blk.31.ffn_down.weight"] == (4096, 14336) and dense["output.weight"] == (128256, 4096)
    assert dense["blk.0.attn_k.weight"] == (1024, 4096)  # 8 KV heads of 128


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q8_0"])
def test_written_file_reads_back_with_every_tensor_in_its_type(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               file_type: str) -> None:
    """The streamed writer (header first, then one tensor at a time) gives a file gguf reads:
    the shapes and types planned, experts metadata, sane weights."""
    tiny = Shape(256, 2, 4, 2, 512, 49152, experts=4, experts_used=2)
    monkeypatch.setitem(SHAPES, "tiny", tiny)
    path = write_model(tmp_path / "m.gguf", "tiny", file_type)
    reader = gguf.GGUFReader(str(path))
    found = {t.name: t for t in reader.tensors}
    planned = model_tensors(tiny)
    assert list(found) == list(planned)
    for name, dims in planned.items():
        assert tuple(int(d) for d in found[name].shape[::-1]) == dims, name
        want = "F32" if name.endswith(("norm.weight", "gate_inp.weight")) else tensor_type(name, file_type, 2)
        assert found[name].tensor_type.name == want, name
    assert int(reader.fields["llama.expert_count"].parts[-1][0]) == 4
    assert int(reader.fields["llama.expert_used_count"].parts[-1][0]) == 2
    down = gguf.quants.dequantize(found["blk.1.ffn_down_exps.weight"].data, found["blk.1.ffn_down_exps.weight"].tensor_type)
    assert down.shape == (4, 256, 512) and 0 < np.abs(down).max() < 0.5
    router = np.asarray(found["blk.0.ffn_gate_inp.weight"].data)
    assert 0.005 < router.std() < 0.05  # a random router, so the routing varies between tokens


def test_metric_rows_take_medians_ratios_and_the_issues_targets() -> None:
    work = Workload(threads=2, streams=(1, 8), prompt=128, gen=64, prefill=(512,))
    arbor = [{"decode_1": 50.0, "decode_8": 300.0, "prefill_512": 300.0, "peak_rss_mib": 1500.0,
              "cold_first_token_s": 9.0, "warm_first_token_s": 7.0, "cold_load_s": 5.0, "warm_load_s": 4.0},
             {"decode_1": 40.0, "decode_8": 320.0, "prefill_512": 260.0, "peak_rss_mib": 1300.0,
              "cold_first_token_s": 8.0, "warm_first_token_s": 6.0, "cold_load_s": 4.0, "warm_load_s": 3.0},
             {"decode_1": 44.0, "decode_8": 310.0, "prefill_512": 280.0, "peak_rss_mib": 1400.0,
              "cold_first_token_s": 7.0, "warm_first_token_s": 5.0, "cold_load_s": 3.0, "warm_load_s": 2.0}]
    llama = [{"decode_1": 50.0, "decode_8": 200.0, "prefill_512": 200.0, "peak_rss_mib": 1000.0,
              "cold_first_token_s": 2.0, "warm_first_token_s": 0.5}]
    rows = {row["figure"]: row for row in metric_rows({"llama.cpp": llama, "arbor": arbor}, work)}
    one = rows["decode, 1 stream, tok/s"]
    assert one["arbor"] == 44.0 and one["arbor range"] == "40-50" and one["llama.cpp"] == 50.0
    assert one["arbor / llama.cpp"] == pytest.approx(0.88) and one["target"] == ">= 1.0x: NOT met"
    assert rows["decode, 8 streams, tok/s"]["target"] == ">= 1.5x: met"  # 310 / 200
    assert rows["prefill 512 tokens, tok/s"]["target"] == ">= 1.2x: met"  # 280 / 200
    assert rows["peak RSS, MiB"]["arbor / llama.cpp"] == pytest.approx(1.4)
    assert rows["peak RSS, MiB"]["target"] == "<= 1.25x: NOT met"
    assert "llama.cpp range" not in one  # one round: no range
    load = rows["Arbor: Engine() on a cold file, s (target <= 3 s)"]
    assert load["arbor"] == 4.0 and "llama.cpp" not in load and "arbor / llama.cpp" not in load
    assert rows["cold start to first token, s"]["arbor / llama.cpp"] == pytest.approx(4.0)
    later = {"arbor": [*arbor, {"prefill_4096": 100.0}], "llama.cpp": llama}  # a round with another size
    assert metric_rows(later, work)[-1] == {"figure": "prefill 4096 tokens, tok/s", "arbor": 100.0}
    alone = metric_rows({"arbor": arbor}, work)  # no peer: figures, no ratios
    assert all("arbor / llama.cpp" not in row for row in alone) and alone[0]["arbor"] == 8.0


def test_default_workloads_fit_the_shape() -> None:
    args = argparse.Namespace(threads=2, streams=None, prompt=None, gen=None, prefill=None)
    assert workload_for("1b", args) == Workload(2, (1, 8, 32), 128, 64, (512, 4096))
    assert workload_for("8b", args) == Workload(2, (1, 8), 64, 32, (512,))
    args.streams, args.prefill = [1, 4], [256]
    assert workload_for("moe", args) == Workload(2, (1, 4), 128, 64, (256,))
