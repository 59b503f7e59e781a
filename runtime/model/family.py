"""A model family: what one architecture does differently from the shared decoder.

Every family runs the same decoder (``llama.py``) over the same paging, runner, sampling,
kernels, quantization, tensor parallelism and fused decode step. A ``Family`` states only
its differences (norms, rotary variant, attention options, MLP kind), and the names it is
known by: HF's ``model_type`` and ``architectures`` in ``config.json``, and GGUF's
``general.architecture``. One module per family under ``runtime/model/families/`` defines
its ``Family``; ``runtime.model.families`` is the one registry of them.

Reading a config goes ``config.json`` (or a GGUF file's metadata, turned into
``config.json`` terms by ``gguf_config.hf_config``) -> ``Family.options`` -> ``ModelArgs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _no_options(cfg: dict[str, Any]) -> dict[str, Any]:
    return {}


def _no_metadata(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    """How one architecture differs from the shared decoder."""

    name: str
    hf_model_types: tuple[str, ...]  # config.json "model_type" values
    hf_architectures: tuple[str, ...] = ()  # config.json "architectures" entries
    gguf_architectures: tuple[str, ...] = ()  # GGUF general.architecture values
    qkv_bias: bool = False  # q / k / v projections carry a bias (also when attention_bias says so)
    qk_norm: bool = False  # an RMSNorm over each q and k head before the rotary (Qwen 3, Gemma 3)
    # llama.cpp's converter permutes the rows of each q / k head for its rotary layout
    # (``LlamaModel.permute`` in convert_hf_to_gguf.py); loading a GGUF file undoes it
    permuted_qk: bool = False
    fused_qkv: bool = False  # the checkpoint holds q, k and v as one weight (Phi-3: qkv_proj / attn_qkv)
    sliding_window: bool = False  # config.json "sliding_window" bounds every layer's attention
    # HF checkpoints store each RMSNorm weight as w of ``x * (1 + w)`` (Gemma): added at load
    norm_offset: float = 0.0
    sandwich_norms: bool = False  # each block's output is normed before its residual add (Gemma)
    activations: tuple[str, ...] = ("silu",)  # the MLP gate activations it accepts
    mlp: str = "dense"  # the feed-forward block (``runtime.model.mlp.MLPBlock`` name)
    # config.json -> extra ``ModelArgs`` fields (checked: raise ValueError naming an unknown key)
    options: Callable[[dict[str, Any]], dict[str, Any]] = field(default=_no_options)
    # GGUF metadata -> extra config.json keys (``gguf_config.hf_config``), e.g. a window
    gguf_metadata: Callable[[dict[str, Any], str], dict[str, Any]] = field(default=_no_metadata)
    # How the family's chat models write tool calls and thinking (``runtime.server.formats``
    # names: "hermes", "llama3_json", "mistral"; "think"); None: read from the chat template
    tool_format: str | None = None
    reasoning_format: str | None = None
