"""Mistral and Ministral: Llama's decoder with every layer's attention bounded to the last
``sliding_window`` positions (HF: key ``j`` is seen from query ``i`` when ``i - W < j <= i``).

How the window meets the paged pool and the radix tree: ``docs/models.md#sliding-windows``.
"""

from __future__ import annotations

from runtime.model.family import Family

MISTRAL = Family(
    name="mistral",
    hf_model_types=("mistral", "ministral"),
    hf_architectures=("MistralForCausalLM", "MinistralForCausalLM"),
    permuted_qk=True,  # GGUF: written as "llama" (families/llama.py)
    sliding_window=True,
    tool_format="mistral",
)
