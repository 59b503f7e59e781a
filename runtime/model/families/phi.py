"""Phi-3 and Phi-4 (mini): q, k and v stored as one weight and gate and up as one, an
optional sliding window on every layer, and (Phi-4-mini) rotary over part of each head
(``partial_rotary_factor``). Their long-context ``longrope`` scaling is ``rope.py``'s (a
GGUF file carries it as ``rope_factors_long`` / ``rope_factors_short``: ``gguf_config.py``).
"""

from __future__ import annotations

from typing import Any

from runtime.model.family import Family


def _gguf_metadata(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    window = meta.get(f"{arch}.attention.sliding_window")
    return {} if not window else {"sliding_window": int(window)}


PHI3 = Family(
    name="phi3",
    hf_model_types=("phi3",),
    hf_architectures=("Phi3ForCausalLM",),
    gguf_architectures=("phi3",),
    fused_qkv=True,
    sliding_window=True,
    mlp="dense_fused",
    gguf_metadata=_gguf_metadata,
)
