"""``arbor models inspect FILE``: what a model is and what it will cost, read from its
header alone (no weight is read, no tokenizer built)."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch

from runtime.model.gguf_config import check_tensors, hf_config
from runtime.model.gguf_file import GGUFFile
from runtime.model.loader import read_config, resolve_source
from runtime.model.memory import GiB, kv_bytes_per_token, parameter_count, weights_nbytes

_KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def inspect_model(model: str, context: int, concurrency: int, kv_dtype: str = "fp32") -> str:
    """A report of ``model`` (a .gguf file, an HF directory or "default"): architecture,
    tensor types, parameters, KV bytes per token and the memory of ``concurrency``
    requests of ``context`` tokens each."""
    source = resolve_source(model)
    lines = [f"model: {source}"]
    if source.is_file():
        gguf = GGUFFile(source)
        try:
            cfg = hf_config(gguf)
            check_tensors(gguf, cfg)
            types = Counter(t.type_name for t in gguf.tensors.values())
            lines += [f"architecture: {gguf.architecture} (file: {gguf.file_size / GiB:.2f} GiB, "
                      f"{len(gguf.tensors)} tensors)",
                      "tensor types: " + ", ".join(f"{name} x{n}" for name, n in types.most_common())]
            weights = weights_nbytes(cfg, "gguf", gguf)
        finally:
            gguf.close()
    else:
        cfg = read_config(Path(source))
        lines.append(f"architecture: {cfg.get('model_type', 'llama')} (HF directory)")
        weights = weights_nbytes(cfg, "fp32")
    per_token = kv_bytes_per_token(cfg, _KV_DTYPES[kv_dtype])
    kv = per_token * context * concurrency
    lines += [
        f"layers {cfg['num_hidden_layers']}, hidden {cfg['hidden_size']}, heads {cfg['num_attention_heads']}/"
        f"{cfg.get('num_key_value_heads') or cfg['num_attention_heads']}, FFN {cfg['intermediate_size']}, "
        f"vocab {cfg['vocab_size']}, context {cfg.get('max_position_embeddings')}",
        f"parameters: {parameter_count(cfg) / 1e9:.3f} B",
        f"weights in memory: {weights / GiB:.2f} GiB ({'its own blocks' if source.is_file() else 'fp32'})",
        f"KV cache ({kv_dtype}): {per_token} bytes per token",
        f"for {concurrency} x {context} tokens: KV {kv / GiB:.2f} GiB, total {(weights + kv) / GiB:.2f} GiB",
    ]
    return "\n".join(lines)


def add_models_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    models = sub.add_parser("models", help="look at a model file without loading it")
    actions = models.add_subparsers(dest="models_command", required=True)
    ins = actions.add_parser("inspect", help="architecture, tensor types, parameters and memory needs of a model")
    ins.add_argument("model", help="a .gguf file, an HF directory, or 'default'")
    ins.add_argument("--context", type=int, default=4096, help="tokens per request (default 4096)")
    ins.add_argument("--concurrency", type=int, default=1, help="requests held at once (default 1)")
    ins.add_argument("--kv-cache-dtype", choices=sorted(_KV_DTYPES), default="fp32",
                     help="the KV cache's stored type (int8: codes plus a scale per head)")
    ins.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args: argparse.Namespace) -> int:
    print(inspect_model(args.model, args.context, args.concurrency, args.kv_cache_dtype))
    return 0
