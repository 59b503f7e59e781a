"""Llama, Llama 2 and 3.x (llama3 rope scaling), SmolLM, TinyLlama: the shared decoder as is.

GGUF: llama.cpp writes Mistral models as ``llama`` too; a window in the metadata makes
the model a Mistral one (``families/mistral.py``).
"""

from __future__ import annotations

from typing import Any

from runtime.model.family import Family
from runtime.model.moe import gguf_moe_config


def _gguf_metadata(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    window = meta.get(f"{arch}.attention.sliding_window")
    out = {} if window is None else {"model_type": "mistral", "sliding_window": int(window)}
    return {**out, **gguf_moe_config(meta, arch)}  # experts: a Mixtral (families/moe.py)


LLAMA = Family(
    name="llama",
    hf_model_types=("llama",),
    hf_architectures=("LlamaForCausalLM",),
    gguf_architectures=("llama",),
    permuted_qk=True,
    gguf_metadata=_gguf_metadata,
)
