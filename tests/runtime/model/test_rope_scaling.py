"""Long-context rotary variants, exact against transformers on tiny random models, with a
prompt longer than the original context (where the scaling matters), from the HF
directory and from a GGUF file carrying them as llama.cpp's converters write them:

- YaRN (Qwen 2.5 / Qwen 3 long context): ``rope.scaling.type = yarn``, its factor and
  original context length;
- LongRoPE (Phi-3 / 3.5 128k): the ``rope_factors_long`` / ``rope_factors_short`` tensors
  and ``rope.scaling.attn_factor``;
- dynamic NTK (HF directory only: llama.cpp has no such type), served within the model's
  ``max_position_embeddings`` and refused past it. LongRoPE's factors are chosen by the longest sequence
  the engine serves (as llama.cpp); transformers chooses by the current sequence, so the two
  agree when both are past the original context, or both within it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from family_models import hf_greedy, write_family_gguf
from test_families import PROMPT, SHAPE

from runtime import Engine, SamplingParams
from runtime.errors import InvalidRequestError
from runtime.model.gguf_file import GGUFFile
from runtime.model.loader import gguf_file

ORIGINAL = 32  # the original context: the prompt is longer
NEW_TOKENS = 32
HALF = SHAPE["head_dim"] // 2
ROPES: dict[str, dict[str, Any]] = {
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
                 "short_factor": [1.0 + 0.05 * i for i in range(HALF)],
                 "long_factor": [1.0 + 1.5 * i for i in range(HALF)]},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
}
DYNAMIC_CONTEXT = 96  # the prompt and its 32 new tokens fit


def _save(kind: str, out: Path) -> Path:
    import shutil

    import transformers as tf

    from runtime.model.default_model import default_model_dir

    torch.manual_seed(0)
    if kind == "yarn":
        model: Any = tf.Qwen2ForCausalLM(tf.Qwen2Config(**SHAPE, rope_parameters=dict(ROPES[kind])))
    elif kind == "dynamic":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**SHAPE, "max_position_embeddings": DYNAMIC_CONTEXT},
                                                   rope_parameters=dict(ROPES[kind])))
    else:
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**SHAPE, rope_parameters=dict(ROPES[kind]),
                                                 original_max_position_embeddings=ORIGINAL))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, out / name)
    return out


def _gguf_rope(kind: str) -> Any:
    """What llama.cpp's converter writes for the rope (``write_family_gguf``'s ``extra``)."""
    import gguf

    def extra(w: Any, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rope = ROPES[kind]
        w.add_rope_scaling_orig_ctx_len(ORIGINAL)
        if kind == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            return {}
        scale = SHAPE["max_position_embeddings"] / ORIGINAL  # llama.cpp's Phi3MiniModel
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL)))
        return {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}

    return extra


@pytest.fixture(scope="module", params=["yarn", "longrope"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoTokenizer

    kind = request.param
    tmp = tmp_path_factory.mktemp(kind)
    hf_dir = _save(kind, tmp / "hf")
    source = GGUFFile(gguf_file("default"))
    try:
        path = write_family_gguf(hf_dir, tmp / f"{kind}.gguf", "qwen2" if kind == "yarn" else "phi3", source,
                                 extra=_gguf_rope(kind))
    finally:
        source.close()
    ids = AutoTokenizer.from_pretrained(str(hf_dir))(PROMPT)["input_ids"]
    assert len(ids) > ORIGINAL
    want, _ = hf_greedy(hf_dir, ids, NEW_TOKENS)
    return {"kind": kind, "hf_dir": hf_dir, "gguf": path, "ids": ids, "want": want}


def _greedy(path: Path, ids: list[int], new_tokens: int = NEW_TOKENS, **config: Any) -> list[int]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with Engine(model=str(path), num_pages=512, **config) as engine:
        return engine.generate(input_ids=[ids], sampling_params=params)[0].token_ids


def test_the_hf_directory_is_exact(model: dict[str, Any]) -> None:
    assert _greedy(model["hf_dir"], model["ids"]) == model["want"]


def test_the_gguf_file_is_exact(model: dict[str, Any]) -> None:
    assert _greedy(model["gguf"], model["ids"], weights="fp32") == model["want"]


@pytest.mark.parametrize("model", ["longrope"], indirect=True)
def test_longrope_within_the_original_context_uses_the_short_factors(model: dict[str, Any]) -> None:
    ids = model["ids"][:16]
    want, _ = hf_greedy(model["hf_dir"], ids, 16)
    assert _greedy(model["hf_dir"], ids, 16, max_model_len=ORIGINAL) == want
    assert _greedy(model["hf_dir"], ids, 16) != want  # the long factors: a different model


def test_dynamic_ntk_within_the_models_context_is_exact(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf_dir = _save("dynamic", tmp_path / "hf")
    ids = AutoTokenizer.from_pretrained(str(hf_dir))(PROMPT)["input_ids"]
    assert len(ids) + NEW_TOKENS <= DYNAMIC_CONTEXT
    want, _ = hf_greedy(hf_dir, ids, NEW_TOKENS)
    assert _greedy(hf_dir, ids) == want
    with pytest.raises(InvalidRequestError, match=r"rope_type 'dynamic' .*\(96 tokens\), not 200"):
        Engine(model=str(hf_dir), num_pages=512, max_model_len=200)
