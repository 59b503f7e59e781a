"""Qwen3-MoE: Qwen 3's attention (q/k RMSNorm, no bias) with an experts block where the
MLP was (``runtime.model.moe``): softmax top-k routing, the top-k probabilities
renormalized when ``norm_topk_prob``; the layers in ``mlp_only_layers`` (or off the
``decoder_sparse_step`` grid) keep a dense MLP. GGUF: llama.cpp's ``qwen3moe``.
"""

from __future__ import annotations

from runtime.model.family import Family
from runtime.model.moe import EXPERTS, gguf_moe_config, moe_options

QWEN3_MOE = Family(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    hf_architectures=("Qwen3MoeForCausalLM",),
    gguf_architectures=("qwen3moe",),
    qk_norm=True,
    mlp=EXPERTS.name,
    options=moe_options,
    gguf_metadata=gguf_moe_config,
    tool_format="hermes",
    reasoning_format="think",
)
