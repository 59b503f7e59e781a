"""The dense MLP passes a long prefill's rows in chunks (its gate / up output is a step's
largest transient), and the chunked result is the whole one."""

from __future__ import annotations

import torch

from runtime.model.llama import ModelArgs
from runtime.model.mlp import MLP, MLP_CHUNK_ROWS

CONFIG = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 96,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "rope_theta": 10000.0}


def test_long_inputs_reach_the_gate_up_matmul_in_chunks_and_give_the_whole_result() -> None:
    torch.manual_seed(0)
    mlp = MLP(ModelArgs.from_hf_config(CONFIG)).eval()
    seen: list[int] = []
    mlp.gate_up_proj.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    x = torch.randn(2 * MLP_CHUNK_ROWS + 7, 32)
    with torch.inference_mode():
        out = mlp(x)
        assert seen == [MLP_CHUNK_ROWS, MLP_CHUNK_ROWS, 7]
        whole = mlp._forward(x)  # the unchunked computation, the oracle
    assert out.shape == x.shape
    torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)


def test_a_decode_sized_batch_is_one_call() -> None:
    mlp = MLP(ModelArgs.from_hf_config(CONFIG)).eval()
    seen: list[int] = []
    mlp.gate_up_proj.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    with torch.inference_mode():
        mlp(torch.randn(MLP_CHUNK_ROWS, 32))
    assert seen == [MLP_CHUNK_ROWS]
