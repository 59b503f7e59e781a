"""Mixtral: Mistral's decoder (its sliding window when the config sets one) with an
experts block in every layer (``runtime.model.moe``): softmax top-k routing, the top-k
probabilities always renormalized. GGUF: llama.cpp writes it as ``llama`` with
``llama.expert_count`` set (``families/llama.py`` sends such a file here).
"""

from __future__ import annotations

from runtime.model.family import Family
from runtime.model.moe import EXPERTS, moe_options

MIXTRAL = Family(
    name="mixtral",
    hf_model_types=("mixtral",),
    hf_architectures=("MixtralForCausalLM",),
    permuted_qk=True,  # GGUF: written as "llama"
    sliding_window=True,
    tool_format="mistral",
    mlp=EXPERTS.name,
    options=moe_options,
)
