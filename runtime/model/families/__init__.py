"""The one registry of model families, keyed by every name a model arrives with.

HF ``config.json`` carries ``model_type`` (and ``architectures``); a GGUF file carries
``general.architecture``. Each family module states one ``Family``; a new family (say a
mixture of experts) registers here with ``register`` and names its MLP block
(``runtime.model.mlp.register_mlp``).
"""

from __future__ import annotations

from typing import Any

from runtime.model.families.gemma import GEMMA2, GEMMA3
from runtime.model.families.llama import LLAMA
from runtime.model.families.mistral import MISTRAL
from runtime.model.families.mixtral import MIXTRAL
from runtime.model.families.phi import PHI3
from runtime.model.families.qwen import QWEN2, QWEN3
from runtime.model.families.qwen3_moe import QWEN3_MOE
from runtime.model.family import Family

FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` to the registry (its name must be new)."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


for _family in (LLAMA, QWEN2, QWEN3, MISTRAL, PHI3, GEMMA2, GEMMA3, QWEN3_MOE, MIXTRAL):
    register(_family)


def family_for_config(cfg: dict[str, Any]) -> Family:
    """The family of an HF ``config.json``: by ``model_type`` (Llama when absent), or by
    ``architectures`` for a config that names that list but no ``model_type``.

    Raises:
        ValueError: no registered family has that name (the message lists the known ones).
    """
    if "model_type" not in cfg:
        for name in cfg.get("architectures") or ():
            for family in FAMILIES.values():
                if name in family.hf_architectures:
                    return family
    model_type = cfg.get("model_type", "llama")
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(known)})")


def family_for_gguf(architecture: str) -> Family:
    """The family of a GGUF ``general.architecture``.

    Raises:
        ValueError: no registered family reads that architecture.
    """
    for family in FAMILIES.values():
        if architecture in family.gguf_architectures:
            return family
    known = sorted(a for f in FAMILIES.values() for a in f.gguf_architectures)
    raise ValueError(f"architecture {architecture!r} is not supported (supported: {', '.join(known)})")
