"""The dense model families, each exact against transformers on a tiny random model of
its own: greedy tokens equal over 32 steps and prompt logits close, from the HF directory
and from a GGUF file written from the same weights; and what cannot be run refused with
``ModelLoadError`` naming it, before anything is loaded.

- Qwen 3: an RMSNorm over each q and k head (tied embeddings here);
- Llama 3: llama3 rope scaling (GGUF: llama.cpp's ``rope_freqs.weight``);
- Phi-3 / Phi-4-mini: fused q/k/v and gate/up weights, rotary over half of each head;
- Mistral: every layer's attention bounded to a 16-token window, on prompts 3x as long,
  with the prefix cache on and off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from family_models import hf_greedy, write_family_gguf

from runtime import Engine, SamplingParams
from runtime.errors import ModelLoadError
from runtime.model.attention import AttentionMetadata
from runtime.model.gguf_file import GGUFFile
from runtime.model.kv_cache import KVCache
from runtime.model.llama import LlamaForCausalLM, ModelArgs
from runtime.model.loader import gguf_file, load_model
from runtime.model.quant import QuantizedLinear

CPU = torch.device("cpu")
WINDOW = 16
NEW_TOKENS = 32
SHAPE: dict[str, Any] = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
# family -> (GGUF architecture, llama.cpp permutes q / k rows)
GGUF_ARCH = {"qwen3": ("qwen3", False), "qwen2": ("qwen2", False), "llama3": ("llama", True),
             "mistral": ("llama", True), "phi3": ("phi3", False), "gemma2": ("gemma2", False),
             "gemma3": ("gemma3", False)}
PROMPT = ("In the quiet town by the river, the baker opened her shop before dawn, and the smell of bread "
          "drifted through the narrow streets where the cats slept on warm stones. Later that morning the "
          "fishermen came back with their nets full, and the children ran down to the harbour to watch.")


def _config(family: str) -> tuple[Any, Any]:
    import transformers as tf

    if family == "qwen3":
        return tf.Qwen3Config(**SHAPE, tie_word_embeddings=True), tf.Qwen3ForCausalLM
    if family == "qwen2":  # Qwen 2.5: q/k/v biases
        return tf.Qwen2Config(**SHAPE, tie_word_embeddings=True), tf.Qwen2ForCausalLM
    if family == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return tf.LlamaConfig(**SHAPE, rope_parameters=rope, tie_word_embeddings=False), tf.LlamaForCausalLM
    if family == "gemma2":
        return tf.Gemma2Config(**SHAPE, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                               final_logit_softcapping=3.0, tie_word_embeddings=True), tf.Gemma2ForCausalLM
    if family == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
        layers = ["sliding_attention", "sliding_attention", "full_attention"]
        return tf.Gemma3TextConfig(**SHAPE, sliding_window=WINDOW, query_pre_attn_scalar=24, rope_parameters=rope,
                                   layer_types=layers, tie_word_embeddings=True), tf.Gemma3ForCausalLM
    if family == "phi3":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        return tf.Phi3Config(**SHAPE, rope_parameters=rope, tie_word_embeddings=False), tf.Phi3ForCausalLM
    assert family == "mistral"
    return tf.MistralConfig(**SHAPE, sliding_window=WINDOW, tie_word_embeddings=False), tf.MistralForCausalLM


def _save(family: str, out: Path) -> Path:
    """Random weights (norms too, so a wrongly placed norm shows), the default model's tokenizer."""
    import shutil

    from runtime.model.default_model import default_model_dir

    config, cls = _config(family)
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (default_model_dir() / name).is_file():
            shutil.copy(default_model_dir() / name, out / name)
    return out


@pytest.fixture(scope="module")
def default_gguf() -> Any:
    gguf = GGUFFile(gguf_file("default"))
    yield gguf
    gguf.close()


@pytest.fixture(scope="module", params=["qwen3", "llama3", "mistral", "phi3", "gemma2", "gemma3"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           default_gguf: GGUFFile) -> dict[str, Any]:
    """The family's HF directory, its GGUF (F32) and Q8_0 files, a prompt and transformers' answer."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    hf_dir = _save(name, tmp / "hf")
    arch, permute = GGUF_ARCH[name]
    files = {q: write_family_gguf(hf_dir, tmp / f"{name}-{q}.gguf", arch, default_gguf, q, permute)
             for q in ("F32", "Q8_0")}
    ids = _prompt_ids(hf_dir)
    want, logits = hf_greedy(hf_dir, ids, NEW_TOKENS)
    return {"name": name, "hf_dir": hf_dir, "gguf": files["F32"], "q8": files["Q8_0"], "ids": ids,
            "want": want, "logits": logits}


def _prompt_ids(hf_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    ids: list[int] = AutoTokenizer.from_pretrained(str(hf_dir))(PROMPT)["input_ids"]
    assert len(ids) >= 3 * WINDOW, "the prompt must be 3x the window"
    return ids


def _greedy(model: str, ids: list[int], **config: Any) -> list[int]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with Engine(model=model, num_pages=512, **config) as engine:
        return engine.generate(input_ids=[ids], sampling_params=params)[0].token_ids


def _prompt_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    """Our logits at every prompt position, one prefill over pool pages 1.. (page size 1)."""
    args, n = model.args, len(ids)
    kv = KVCache(args.num_layers, n + 1, 1, args.num_kv_heads, args.head_dim, torch.float32, CPU)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(kv=kv, out_slots=torch.arange(1, n + 1), num_extend_tokens=n,
                             extend_page_table=i32([list(range(1, n + 1))]), extend_prefix_lens=i32([0]),
                             extend_lens=i32([n]), extend_qo_indptr=i32([0, n]),
                             decode_page_table=torch.zeros(0, 1, dtype=torch.int32), decode_seq_lens=i32([]))
    return model(torch.tensor(ids), torch.arange(n), meta, torch.arange(n))


def test_hf_directory_is_exact(family: dict[str, Any]) -> None:
    ours = load_model(family["hf_dir"], CPU, torch.float32, max_positions=256)
    assert ours.args.family == {"llama3": "llama"}.get(family["name"], family["name"])
    torch.testing.assert_close(_prompt_logits(ours, family["ids"]), family["logits"], atol=1e-4, rtol=1e-4)
    assert _greedy(str(family["hf_dir"]), family["ids"]) == family["want"]


def test_gguf_file_is_exact(family: dict[str, Any]) -> None:
    """The GGUF file of the same weights (F32), dequantized: transformers' tokens."""
    assert _greedy(str(family["gguf"]), family["ids"], weights="fp32") == family["want"]


def test_gguf_blocks_run_natively(family: dict[str, Any]) -> None:
    """A Q8_0 file of the family runs in its own blocks (the default) and agrees with the
    same file dequantized to fp32 on the first tokens."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    with Engine(model=str(family["q8"]), num_pages=512) as native:
        assert isinstance(native.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
        got = native.generate(input_ids=[family["ids"]], sampling_params=params)[0].token_ids
    with Engine(model=str(family["q8"]), num_pages=512, weights="fp32") as fp32:
        want = fp32.generate(input_ids=[family["ids"]], sampling_params=params)[0].token_ids
    assert got == want


def test_int8_weights_and_int8_kv_run_every_family(family: dict[str, Any]) -> None:
    """Quantized weights and KV are approximations: what is checked is that the family's
    own parts (q/k norms, windows) survive quantization and the first token agrees."""
    got = _greedy(str(family["hf_dir"]), family["ids"], weights="int8", kv_cache_dtype="int8")
    assert len(got) == NEW_TOKENS and got[0] == family["want"][0]


@pytest.mark.parametrize("family", ["mistral", "gemma3"], indirect=True)
def test_sliding_window_with_and_without_the_prefix_cache(family: dict[str, Any]) -> None:
    """Window 16 (Mistral: every layer; Gemma 3: two of three), prompt 3x that: exact with
    the radix cache off, and on, where a second request shares the first 40 prompt tokens
    (pages out of the window included)."""
    model, ids = str(family["hf_dir"]), family["ids"]
    assert _greedy(model, ids, disable_prefix_cache=True) == family["want"]
    other = ids[:40] + ids[-8:][::-1]
    other_want, _ = hf_greedy(family["hf_dir"], other, NEW_TOKENS)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with Engine(model=model, num_pages=512) as engine:
        assert engine.generate(input_ids=[ids], sampling_params=params)[0].token_ids == family["want"]
        second = engine.generate(input_ids=[other], sampling_params=params)[0]
    assert second.token_ids == other_want
    assert second.num_cached_tokens >= 40


# ---- what is refused ---------------------------------------------------------------------------
def _hf_dir_with(tmp_path: Path, source: Path, **changes: Any) -> Path:
    import shutil

    out = tmp_path / "changed"
    shutil.copytree(source, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **changes}))
    return out


@pytest.mark.parametrize(("changes", "message"), [
    ({"model_type": "gpt_bigcode"}, "unsupported model_type 'gpt_bigcode'"),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 10000.0}}, "unsupported rope_type 'proportional'"),
    ({"hidden_act": "relu2"}, "unsupported activation 'relu2' for a llama model"),
    ({"layer_types": ["chunked_attention"] * 2}, r"unsupported layer type\(s\) \['chunked_attention'\]"),
])
def test_unknown_config_is_named_before_loading(tmp_path: Path, tiny_llama_dir: Path, changes: dict[str, Any],
                                                message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        Engine(model=str(_hf_dir_with(tmp_path, tiny_llama_dir, **changes)), num_pages=64)


def test_a_missing_gguf_tensor_of_the_family_is_named(tmp_path: Path, default_gguf: GGUFFile) -> None:
    hf_dir = _save("qwen3", tmp_path / "hf")
    path = write_family_gguf(hf_dir, tmp_path / "q.gguf", "qwen3", default_gguf, drop=("blk.1.attn_k_norm.weight",))
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.1.attn_k_norm.weight' missing"):
        Engine(model=str(path), num_pages=64)


def test_unknown_gguf_architecture_is_named(tmp_path: Path, tiny_llama_dir: Path, default_gguf: GGUFFile) -> None:
    path = write_family_gguf(tiny_llama_dir, tmp_path / "x.gguf", "grok", default_gguf)
    with pytest.raises(ModelLoadError, match=r"architecture 'grok' is not supported \(supported: .*qwen3"):
        Engine(model=str(path), num_pages=64)


def test_a_family_is_found_by_architectures_when_model_type_is_absent() -> None:
    cfg = {k: v for k, v in SHAPE.items() if k not in ("bos_token_id", "eos_token_id")}
    args = ModelArgs.from_hf_config({**cfg, "architectures": ["Qwen3ForCausalLM"]})
    assert args.family == "qwen3" and args.qk_norm and not args.qkv_bias
    mistral = ModelArgs.from_hf_config({**cfg, "model_type": "mistral", "sliding_window": 24})
    assert mistral.layer_windows == (24, 24, 24) and mistral.window(2) == 24
    assert mistral.kv_window == 24  # every layer windowed: K/V behind it is dead (scheduler drops it)
    unbounded = ModelArgs.from_hf_config({**cfg, "model_type": "mistral", "sliding_window": None})
    assert unbounded.layer_windows == () and unbounded.kv_window is None
    qwen2 = ModelArgs.from_hf_config({**cfg, "model_type": "qwen2", "sliding_window": 24,
                                      "layer_types": ["full_attention", "sliding_attention", "full_attention"]})
    assert qwen2.layer_windows == (None, 24, None) and qwen2.kv_window is None  # a global layer reads it all


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma2", "mistral", "gemma3"], indirect=True)
def test_tensor_parallel_gives_the_one_rank_tokens(family: dict[str, Any]) -> None:
    """Two gloo ranks (q/k norms, fused checkpoints with partial rotary, Gemma's norms,
    scales, windows and caps; Mistral's pages dropped behind its window, Gemma 3's
    local/global layers): the greedy tokens of one rank."""
    model, ids = str(family["hf_dir"]), family["ids"]
    assert _greedy(model, ids, tensor_parallel_size=2, num_threads=1) == _greedy(model, ids, num_threads=1)


def test_stop_tokens_come_from_the_files(tmp_path: Path, tiny_llama_dir: Path, default_gguf: GGUFFile) -> None:
    """generation_config.json's end-of-turn ids (HF) and llama.cpp's eot / eom ids (GGUF)
    end generation beside EOS."""
    import shutil

    from runtime.model.gguf_config import hf_config

    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_llama_dir, hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    with Engine(model=str(hf_dir), num_pages=64) as engine:
        assert engine.eos_token_ids == [2, 7]
    out = tmp_path / "eot.gguf"
    write_family_gguf(tiny_llama_dir, out, "llama", default_gguf, permute_qk=True, metadata={
        "tokenizer.ggml.eot_token_id": 9, "tokenizer.ggml.eom_token_id": 11})
    file = GGUFFile(out)
    assert hf_config(file)["eos_token_id"] == [2, 9, 11]
    file.close()


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                  "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_an_openai_chat_call_renders_the_files_own_template(tmp_path: Path, default_gguf: GGUFFile) -> None:
    """A Gemma 3 GGUF carrying Gemma's chat template, served: the chat prompt is that
    template's rendering (its token count), not the default model's ChatML."""
    import openai
    from fastapi.testclient import TestClient

    from runtime.server import create_app

    hf_dir = _save("gemma3", tmp_path / "hf")
    path = write_family_gguf(hf_dir, tmp_path / "gemma3.gguf", "gemma3", default_gguf, chat_template=GEMMA_TEMPLATE)
    messages: list[Any] = [{"role": "user", "content": "Name a colour."}]
    with Engine(model=str(path), num_pages=256, max_model_len=256) as engine:
        rendered = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == "<|im_start|><start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
        with TestClient(create_app(engine, model_name="gemma")) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                                   http_client=http)
            got = client.chat.completions.create(model="gemma", messages=messages, max_tokens=4, temperature=0)
    assert got.usage is not None
    assert got.usage.prompt_tokens == len(engine.tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert got.choices[0].finish_reason in ("length", "stop")
