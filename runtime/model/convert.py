"""One-time conversion of a GGUF file into an HF-style directory.

transformers reads GGUF with the ``gguf`` package: it dequantizes the weights, undoes
llama.cpp's q/k permutation and builds the tokenizer with its standard converters. That
takes ~30 s for the default model, mostly Python overhead, so we do it once and save
``config.json`` + ``model.safetensors`` + tokenizer files; later loads take seconds.
transformers refuses ``save_pretrained`` on a GGUF-loaded model, so we write the state
dict with safetensors ourselves (without the tied ``lm_head.weight``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from runtime.errors import ModelLoadError


def convert_gguf_to_hf_dir(gguf_file: Path, out_dir: Path) -> Path:
    """Convert ``gguf_file`` into ``out_dir`` (written atomically). Returns ``out_dir``."""
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_file}")
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
        )
    except Exception as exc:  # transformers raises many types for a bad file
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"cannot read GGUF file {gguf_file}: {exc}") from exc
    tokenizer.save_pretrained(tmp)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    safetensors.torch.save_file(state, str(tmp / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)
    return out_dir
