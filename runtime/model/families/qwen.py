"""Qwen 2 / 2.5 (q/k/v bias) and Qwen 3 (an RMSNorm over each q and k head, no bias).

Neither's GGUF q / k rows are permuted (llama.cpp's Qwen converters keep HF's order).
"""

from __future__ import annotations

from runtime.model.family import Family

QWEN2 = Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    hf_architectures=("Qwen2ForCausalLM",),
    gguf_architectures=("qwen2",),
    qkv_bias=True,
    tool_format="hermes",
)

QWEN3 = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    hf_architectures=("Qwen3ForCausalLM",),
    gguf_architectures=("qwen3",),
    qk_norm=True,
    tool_format="hermes",
    reasoning_format="think",
)
