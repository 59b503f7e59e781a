"""Find and load a model: what to do is decided by the files, not by flags.

- ``"default"`` (or None): the embedded SmolLM2-135M-Instruct's GGUF file.
- a directory with ``config.json`` + ``*.safetensors``: an HF-style model.
- a ``.gguf`` file: the model itself. Config, tokenizer and weights are read from it
  (``gguf_file.py``, ``gguf_config.py``, ``gguf_tokenizer.py``, ``gguf_weights.py``).

``resolve_model_dir`` converts a GGUF file into an HF-style directory through
transformers: the reference that tests and benchmarks compare against, never the engine's
way in.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from runtime import env
from runtime.errors import ModelLoadError
from runtime.model.convert import convert_gguf_to_hf_dir
from runtime.model.default_model import default_gguf_file, default_model_dir, is_default
from runtime.model.families import FAMILIES
from runtime.model.llama import LlamaForCausalLM, ModelArgs
from runtime.model.mlp import mlp_block


def resolve_source(model: str | None) -> Path:
    """Where ``model``'s weights are: an HF-style directory or a ``.gguf`` file (the
    default model's, fetched on first use).

    Raises:
        ModelLoadError: the path is missing, a file that is not ``.gguf``, or a directory
            without ``config.json`` / ``*.safetensors``.
    """
    if is_default(model):
        return default_gguf_file()
    assert model is not None
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    return resolve_model_dir(model)


def resolve_model_dir(model: str | None) -> Path:
    """The HF-style directory for ``model``; a GGUF file (or the default model) is
    converted through transformers on first use. For references (tests, benchmarks, eval
    against HF): the engine reads GGUF files directly (``resolve_source``)."""
    if is_default(model):
        return default_model_dir()
    assert model is not None
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {model}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{model} is a file but not a .gguf file")
        return _converted_gguf_dir(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{model} has no config.json: not an HF-style model directory")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{model} has no *.safetensors weights")
    return path


def gguf_file(model: str | None) -> Path:
    """The GGUF file ``model`` comes from (the default model's, or a ``.gguf`` path).

    Raises:
        ModelLoadError: ``model`` is an HF directory (no GGUF blocks to load).
    """
    if is_default(model):
        return default_gguf_file()
    assert model is not None
    path = Path(model).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        raise ModelLoadError(f"weights='gguf' needs a .gguf model file (or the default model), got {model}")
    return path


def _converted_gguf_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    out = env.cache_dir() / "models" / f"{gguf.stem}-{key[:12]}"
    if (out / "config.json").exists():
        return out
    return convert_gguf_to_hf_dir(gguf, out)


def read_config(model_dir: Path) -> dict[str, Any]:
    """``config.json``, its ``eos_token_id`` joined with ``generation_config.json``'s (where
    instruct models list their end-of-turn tokens: Llama 3's ``<|eot_id|>``, Gemma's
    ``<end_of_turn>``, Qwen's ``<|im_end|>`` beside ``<|endoftext|>``)."""
    cfg: dict[str, Any] = _read_json(model_dir / "config.json")
    generation = model_dir / "generation_config.json"
    extra = _read_json(generation).get("eos_token_id") if generation.is_file() else None
    if extra is not None:
        ids = sorted({*eos_token_ids({"eos_token_id": extra}, None), *eos_token_ids(cfg, None)})
        if ids != eos_token_ids(cfg, None):  # NOTE: an unchanged config keeps its own form
            cfg["eos_token_id"] = ids
    return cfg


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return value


def load_model(
    model_dir: Path, device: torch.device, dtype: torch.dtype, max_positions: int
) -> LlamaForCausalLM:
    """Build the model from ``config.json`` and load its safetensors weights."""
    args = model_args(read_config(model_dir), model_dir)
    check_checkpoint(model_dir, args)
    state = _fused_state_dict(_read_safetensors(model_dir), args)
    return build_model(args, state, device, dtype, max_positions)


def model_args(hf_config: dict[str, Any], where: Path) -> ModelArgs:
    """``ModelArgs`` of ``hf_config``, checked by building the model on the meta device.

    Raises:
        ModelLoadError: a config we cannot run (unknown model_type, rope_type...).
    """
    try:  # NOTE: building the (meta) model checks the rest of the config: rope_type...
        args = ModelArgs.from_hf_config(hf_config)
        with torch.device("meta"):
            LlamaForCausalLM(args, 2)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"unsupported model config in {where}: {exc}") from exc
    return args


def build_model(args: ModelArgs, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                max_positions: int) -> LlamaForCausalLM:
    """The model of ``args`` holding ``state`` (our module names, fp32), in ``dtype``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(args, max_positions)
    model.load_state_dict(state, strict=True, assign=True)
    model.build_rope(max_positions)  # real buffers
    return model.to(device=device, dtype=dtype).eval()


def check_checkpoint(model_dir: Path, args: ModelArgs) -> None:
    """Raise ``ModelLoadError`` naming the first weight ``args``' model needs that the
    checkpoint lacks, from the files' headers alone (before any weight is read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                names.update(f.keys())
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read weights {file}: {exc}") from exc
    # NOTE: empty CPU tensors stand in for the weights (only the names are checked); meta
    # tensors would route torch.cat through the reference ops, which import torch._dynamo
    # and Triton into a CPU engine (tests/runtime/test_engine_memory.py).
    empty = torch.empty(0)
    _fused_state_dict(dict.fromkeys(names, empty), args)


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read weights {file}: {exc}") from exc
    return tensors


def _fused_state_dict(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Map HF parameter names onto ours, concatenating q/k/v and gate/up."""

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ModelLoadError(f"weight {name!r} missing from the checkpoint")
        return hf[name].float()

    family = FAMILIES[args.family]
    out = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(args.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        out[dst + "self_attn.qkv_proj.weight"] = take(attn + "qkv_proj.weight") if family.fused_qkv \
            else torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"])
        if args.qkv_bias:
            out[dst + "self_attn.qkv_proj.bias"] = torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"])
        out[dst + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight")
        if args.qk_norm:
            out[dst + "self_attn.q_norm.weight"] = take(attn + "q_norm.weight")
            out[dst + "self_attn.k_norm.weight"] = take(attn + "k_norm.weight")
        out.update(mlp_block(args.mlp).hf_state(take, src + "mlp.", dst + "mlp.", args))
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        if args.sandwich_norms:  # Gemma's HF names: post_attention_layernorm is the attention's output norm
            out[dst + "attn_output_norm.weight"] = take(src + "post_attention_layernorm.weight")
            out[dst + "post_attention_layernorm.weight"] = take(src + "pre_feedforward_layernorm.weight")
            out[dst + "mlp_output_norm.weight"] = take(src + "post_feedforward_layernorm.weight")
        else:
            out[dst + "post_attention_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
    if family.norm_offset:  # NOTE: x * (1 + w) in fp32, as HF computes it
        out.update({k: v + family.norm_offset for k, v in out.items() if k.endswith("norm.weight")})
    return out


def load_tokenizer(model_dir: Path) -> Any:
    """The model's HF tokenizer (fast), with its chat template."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc


def eos_token_ids(hf_config: dict[str, Any], tokenizer_eos: int | None) -> list[int]:
    """Every id that ends generation: the config's ``eos_token_id`` (an id or a list) and
    the tokenizer's."""
    ids: set[int] = set()
    for source in (hf_config.get("eos_token_id"), tokenizer_eos):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(i) for i in source)
    return sorted(ids)
