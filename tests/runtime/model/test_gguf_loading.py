"""A GGUF file is the model: config, tokenizer, chat template and weights read from the
file itself (no converted directory), the file's own blocks by default, bad files refused
with ``ModelLoadError`` naming the problem, and the memory a model needs known (and
checked) before it is loaded.

Small files are written here with the ``gguf`` package's writer; the tokenizer of the tiny
ones is the default model's (copied from its metadata), so the engine can run them.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from runtime import Engine, SamplingParams, engine_setup
from runtime.config import EngineConfig
from runtime.errors import ModelLoadError
from runtime.model.gguf_config import check_tensors, hf_config
from runtime.model.gguf_file import GGUFFile
from runtime.model.gguf_tokenizer import gguf_tokenizer
from runtime.model.gguf_weights import gguf_state_dict
from runtime.model.llama import ModelArgs
from runtime.model.loader import gguf_file, read_config, resolve_model_dir
from runtime.model.memory import parameter_count, weights_nbytes
from runtime.model.quant import QuantizedLinear, quantized_nbytes

CPU = torch.device("cpu")
TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128}


@pytest.fixture(scope="module")
def default_gguf() -> Any:
    gguf = GGUFFile(gguf_file("default"))
    yield gguf
    gguf.close()


def write_gguf(path: Path, source: GGUFFile, qtype: str = "Q8_0", drop: tuple[str, ...] = (),
               ffn_in_metadata: int | None = None, arch: str = "llama", tiny: dict[str, int] = TINY,
               q6_k: tuple[str, ...] = (), types: dict[str, str] | None = None) -> Path:
    """A 2-layer Llama (``tiny``: hidden 64, 4/2 heads of 16, FFN 128, untied head) of random
    weights in ``qtype`` blocks (norms F32), with ``source``'s tokenizer; ``drop``: tensors
    left out; ``ffn_in_metadata``: a feed_forward_length that contradicts the tensors;
    ``q6_k``: tensors (name stems, e.g. "ffn_down") written in Q6_K instead; ``types``: name
    stems (e.g. "attn_q", "blk.0.attn_v") -> the type gguf's quantizer writes them in."""
    import gguf

    from kernels.reference import q6_k as Q6

    rng = np.random.default_rng(0)
    t = tiny
    vocab = len(source.metadata["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(t["layers"])
    w.add_context_length(512)
    w.add_embedding_length(t["hidden"])
    w.add_feed_forward_length(ffn_in_metadata or t["ffn"])
    w.add_head_count(t["heads"])
    w.add_head_count_kv(t["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(source.metadata["tokenizer.ggml.pre"])
    w.add_token_list(source.metadata["tokenizer.ggml.tokens"])
    w.add_token_types(source.metadata["tokenizer.ggml.token_type"].tolist())
    w.add_token_merges(source.metadata["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(source.metadata["tokenizer.chat_template"])
    h, f, q, kv = t["hidden"], t["ffn"], t["heads"] * 16, t["kv_heads"] * 16
    shapes = {"token_embd.weight": (vocab, h), "output.weight": (vocab, h), "output_norm.weight": (h,)}
    for i in range(t["layers"]):
        shapes.update({f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
                       f"blk.{i}.attn_q.weight": (q, h), f"blk.{i}.attn_k.weight": (kv, h),
                       f"blk.{i}.attn_v.weight": (kv, h), f"blk.{i}.attn_output.weight": (h, q),
                       f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
                       f"blk.{i}.ffn_down.weight": (h, f)})
    kind = gguf.GGMLQuantizationType[qtype]
    for name, shape in shapes.items():
        if name in drop:
            continue
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        elif any(f"{stem}.weight" in name for stem in q6_k):
            codes, d = Q6.quantize(torch.from_numpy(0.1 * rng.standard_normal(shape)).float())
            w.add_tensor(name, Q6.to_blocks(codes, d).numpy(), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
        else:
            values = (0.1 * rng.standard_normal(shape)).astype(np.float32)
            stem = next((s for s in types or {} if f"{s}.weight" in name), None)
            this = kind if stem is None else gguf.GGMLQuantizationType[(types or {})[stem]]
            w.add_tensor(name, gguf.quants.quantize(values, this), raw_dtype=this)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, default_gguf: GGUFFile) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", default_gguf)


# ---- the metadata is the model -------------------------------------------------------------
TEXTS = [
    "Hello world", "  leading and trailing spaces  ", "Ünïcödé façade — naïve café", "日本語のテキストです。",
    "Привет, мир! Как дела?", "مرحبا بالعالم", "नमस्ते दुनिया", "한국어 문장입니다",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "emoji 🤖🚀 and symbols ∑∫√",
    "\t\ttabs\n\n\nnewlines\r\n", "1234567890 3.14159 1e-10 0xFF", "SELECT * FROM t WHERE a='b';",
]


def test_the_tokenizer_from_the_metadata_is_the_converted_one(default_gguf: GGUFFile) -> None:
    """Token ids, special tokens, chat template and decoding equal transformers' tokenizer
    of the converted default model (its tokenizer.json)."""
    from transformers import AutoTokenizer

    ours, ref = gguf_tokenizer(default_gguf), AutoTokenizer.from_pretrained(str(resolve_model_dir("default")))
    for text in TEXTS:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template"):
        assert getattr(ours, name) == getattr(ref, name), name
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    ids = ref("Ünïcödé 日本 <|im_end|> def f():")["input_ids"]
    assert ours.decode(ids) == ref.decode(ids) and len(ours) == len(ref)


def test_the_config_from_the_metadata_is_the_converted_one(default_gguf: GGUFFile) -> None:
    converted = read_config(resolve_model_dir("default"))
    ours = hf_config(default_gguf)
    assert ModelArgs.from_hf_config(ours) == ModelArgs.from_hf_config(converted)
    assert (ours["bos_token_id"], ours["eos_token_id"]) == (converted["bos_token_id"], converted["eos_token_id"])
    assert ours["tie_word_embeddings"] is True  # no output.weight in the file


def test_fp32_weights_dequantized_from_the_map_equal_transformers(tiny_gguf: Path) -> None:
    """Tensor by tensor from the file (q / k rows un-permuted): exactly transformers'
    ``from_pretrained(gguf_file=...)`` of the same file."""
    from transformers import AutoModelForCausalLM

    gguf = GGUFFile(tiny_gguf)
    args = ModelArgs.from_hf_config(hf_config(gguf))
    ours = gguf_state_dict(gguf, args)
    gguf.close()
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                              dtype=torch.float32).state_dict()
    attn = "model.layers.1.self_attn."
    assert torch.equal(ours["layers.1.self_attn.qkv_proj.weight"],
                       torch.cat([hf[attn + f"{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(ours["layers.0.mlp.down_proj.weight"], hf["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(ours["embed_tokens.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"])


def test_an_engine_on_a_gguf_file_runs_its_blocks_by_default(tiny_gguf: Path) -> None:
    """``weights="auto"`` on a GGUF file keeps its blocks; "fp32" opts in to the
    dequantized weights, whose greedy tokens are transformers' on the same file."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(model=str(tiny_gguf), num_pages=256) as native:
        assert isinstance(native.model.layers[0].mlp.down_proj, QuantizedLinear)
        assert native.model_dir == tiny_gguf
        assert len(native.generate(["Hello"], params)[0].token_ids) == 8
    with Engine(model=str(tiny_gguf), weights="fp32", num_pages=256) as fp32:
        ids = fp32.tokenizer("The capital of France is")["input_ids"]
        ours = fp32.generate(input_ids=[ids], sampling_params=params)[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert ours == want[0, len(ids):].tolist()


def test_auto_weights_are_the_sources_own_format() -> None:
    assert engine_setup.resolve_weights("auto", CPU, gguf_source=True) == "gguf"
    assert engine_setup.resolve_weights("auto", CPU, gguf_source=False) == "fp32"
    assert engine_setup.resolve_weights("auto", CPU, gguf_source=True, tensor_parallel_size=2) == "fp32"
    assert engine_setup.resolve_weights("int4", CPU, gguf_source=True) == "int4"


# ---- bad files ---------------------------------------------------------------------------------
def _patch(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def _type_id_offset(path: Path, name: str) -> int:
    """Byte offset of tensor ``name``'s ggml type id in the tensor table."""
    blob = path.read_bytes()
    at = blob.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", blob, at)
    return at + 4 + 8 * n_dims


def _bad_file(kind: str, tiny: Path, tmp: Path, source: GGUFFile) -> Path:
    path = tmp / f"{kind}.gguf"
    if kind == "missing-tensor":
        return write_gguf(path, source, drop=("blk.1.ffn_up.weight",))
    if kind == "shape":
        return write_gguf(path, source, ffn_in_metadata=96)
    if kind == "architecture":
        return write_gguf(path, source, arch="mamba")
    blob = tiny.read_bytes()
    if kind == "truncated-data":
        path.write_bytes(blob[: len(blob) - 1000])
    elif kind == "truncated-header":
        path.write_bytes(blob[:5000])
    elif kind == "truncated-table":  # the cut falls in the tensor table
        gguf = GGUFFile(tiny)
        table_end = gguf.tensors["token_embd.weight"].offset
        gguf.close()
        path.write_bytes(blob[: table_end - 300])
    elif kind == "tiny":
        path.write_bytes(blob[:10])
    elif kind == "magic":
        path.write_bytes(b"GGML" + blob[4:])
    elif kind == "version":
        path.write_bytes(blob)
        _patch(path, 4, struct.pack("<I", 99))
    elif kind == "tensor-type":
        path.write_bytes(blob)
        _patch(path, _type_id_offset(path, "blk.0.ffn_down.weight"), struct.pack("<I", 1234))
    return path


@pytest.mark.parametrize(("kind", "message"), [
    ("truncated-data", r"truncated GGUF file: tensor 'blk.1.ffn_down.weight' \(Q8_0 \[128, 64\]\) ends at byte 8534400, "
                       "the file has 8533400"),
    ("truncated-header", "truncated or corrupt GGUF file: metadata 'tokenizer.ggml.tokens' claims 49152 strings"),
    ("truncated-table", r"truncated or corrupt GGUF file \(in its header\): unpack_from requires"),
    ("tiny", "truncated GGUF file \\(10 bytes"),
    ("magic", "not a GGUF file \\(starts with b'GGML'"),
    ("version", "GGUF version 99 is not supported"),
    ("tensor-type", "tensor 'blk.0.ffn_down.weight' has unknown ggml type id 1234"),
    ("missing-tensor", "tensor 'blk.1.ffn_up.weight' missing"),
    ("shape", r"tensor 'blk.0.ffn_gate.weight' has shape \[64, 128\], but the metadata \(llama.\*\) implies "
              r"\[64, 96\]"),
    ("architecture", "architecture 'mamba' is not supported"),
])
def test_a_bad_file_is_refused_naming_the_problem(kind: str, message: str, tiny_gguf: Path, tmp_path: Path,
                                                  default_gguf: GGUFFile,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each is found in the header or the tensor table, before the tokenizer is built or a
    weight is read."""
    path = _bad_file(kind, tiny_gguf, tmp_path, default_gguf)
    monkeypatch.setattr(engine_setup, "_load_weights", _never)
    monkeypatch.setattr(engine_setup, "gguf_tokenizer", _never)
    with pytest.raises(ModelLoadError, match=message):
        Engine(model=str(path), num_pages=64)


def _never(*args: Any) -> Any:
    raise AssertionError("reached after a bad file")


# ---- memory known before loading -------------------------------------------------------------
def test_a_model_that_cannot_fit_is_refused_with_its_numbers(tiny_gguf: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_setup, "available_memory_bytes", lambda: 64 << 20)
    monkeypatch.setattr(engine_setup, "_load_weights", _never)
    # a token's KV: 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes = 512 B
    with pytest.raises(ModelLoadError, match=r"does not fit in memory: needs 19\.08 GiB \(weights 0\.01 GiB .*"
                                             r"KV pool 40000000 tokens x 512 B = 19\.07 GiB; 0\.1 GiB available"):
        Engine(model=str(tiny_gguf), num_pages=40_000_000)


def test_the_planned_weight_bytes_are_the_loaded_ones(tiny_gguf: Path) -> None:
    gguf = GGUFFile(tiny_gguf)
    cfg = hf_config(gguf)
    check_tensors(gguf, cfg)
    planned = weights_nbytes(cfg, "gguf", gguf)
    gguf.close()
    with Engine(model=str(tiny_gguf), num_pages=64) as engine:
        norms = sum(p.numel() * 4 for p in engine.model.parameters())
        loaded = quantized_nbytes(engine.model) + norms
    assert planned == loaded
    h, f, v = 64, 128, 49152
    assert parameter_count(cfg) == 2 * v * h + h + 2 * (2 * h + h * 64 * 2 + 2 * h * 32 + 3 * h * f)


def test_q6_k_tensors_are_held_as_stored(tmp_path: Path, default_gguf: GGUFFile) -> None:
    """A K-quant mix's Q6_K tensors (here ffn_down, output and attn_v; the rest Q8_0):
    where the kernels read tiles, down and the head stay 6-bit (tiled), v beside Q8_0 q and
    k becomes int8 in groups of 32; every weight is the file's (gguf's dequantization, v
    within its int8 step); the planned bytes are the loaded ones; the engine decodes."""
    import kernels
    from kernels.reference.quant import dequantize

    path = write_gguf(tmp_path / "q6k.gguf", default_gguf, tiny={**TINY, "hidden": 256, "heads": 16, "kv_heads": 8,
                                                                 "ffn": 512}, q6_k=("ffn_down", "output", "attn_v"))
    gguf = GGUFFile(path)
    cfg = hf_config(gguf)
    fp32 = gguf_state_dict(gguf, ModelArgs.from_hf_config(cfg))
    engine_setup.enable_cpu_kernels()
    planned = weights_nbytes(cfg, "gguf", gguf)
    gguf.close()
    with Engine(model=str(path), num_pages=64) as engine:
        model = engine.model
        down, head, qkv = model.layers[1].mlp.down_proj.weight, model.lm_head.weight, model.layers[1].self_attn.qkv_proj.weight
        assert (down.bits, head.bits) == ((6, 6) if kernels.reads_tiles() else (8, 8))
        assert (qkv.bits, qkv.blocks_per_group) == (8, 1)
        if kernels.reads_tiles():
            assert down.tiled and head.tiled
            assert torch.equal(dequantize(down), fp32["layers.1.mlp.down_proj.weight"])
            assert torch.equal(dequantize(head), fp32["lm_head.weight"])
        v = fp32["layers.1.self_attn.qkv_proj.weight"][-128:]
        assert ((dequantize(qkv)[-128:] - v).abs().max() <= v.abs().max() / 127).item()
        norms = sum(p.numel() * 4 for p in model.parameters())
        assert quantized_nbytes(model) + norms == planned
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(engine.generate(["Hello"], params)[0].token_ids) == 4


# a Q4_K_M-like mix of a model whose rows are not whole superblocks: Q5_0 where Q4_K would be
Q5_MIX = {"attn_q": "Q5_0", "attn_k": "Q5_0", "blk.0.attn_v": "Q8_0", "blk.1.attn_v": "Q5_0",
          "attn_output": "Q5_1", "ffn_gate": "Q4_1", "ffn_up": "Q5_1", "ffn_down": "Q4_0", "token_embd": "Q5_0",
          "output": "Q5_1"}


def test_q5_tensors_are_held_in_5_bits(tmp_path: Path, default_gguf: GGUFFile) -> None:
    """Q5_0 / Q5_1 tensors are 5-bit codes (tiled where the kernels read tiles), and so is a
    fused weight of Q5 and 4-bit parts (the 4-bit codes widened to 5); one beside Q8_0 is
    8-bit; every weight is exactly gguf's dequantization; the planned bytes are the loaded
    ones; the engine decodes."""
    import kernels
    from kernels.reference.quant import dequantize

    path = write_gguf(tmp_path / "q5.gguf", default_gguf, types=Q5_MIX)
    gguf = GGUFFile(path)
    cfg = hf_config(gguf)
    fp32 = gguf_state_dict(gguf, ModelArgs.from_hf_config(cfg))
    engine_setup.enable_cpu_kernels()
    planned = weights_nbytes(cfg, "gguf", gguf)
    gguf.close()
    with Engine(model=str(path), num_pages=64) as engine:
        model = engine.model
        weights = {"lm_head.weight": model.lm_head.weight}
        for i in (0, 1):
            layer = model.layers[i]
            weights.update({f"layers.{i}.self_attn.qkv_proj.weight": layer.self_attn.qkv_proj.weight,
                            f"layers.{i}.self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                            f"layers.{i}.mlp.gate_up_proj.weight": layer.mlp.gate_up_proj.weight,
                            f"layers.{i}.mlp.down_proj.weight": layer.mlp.down_proj.weight})
        bits = {name: w.bits for name, w in weights.items()}
        assert bits == {"lm_head.weight": 5, "layers.0.self_attn.qkv_proj.weight": 8,
                        "layers.1.self_attn.qkv_proj.weight": 5, **{f"layers.{i}.{n}.weight": b for i in (0, 1)
                        for n, b in (("self_attn.o_proj", 5), ("mlp.gate_up_proj", 5), ("mlp.down_proj", 4))}}
        assert all(w.tiled == kernels.reads_tiles() for w in weights.values())
        for name, w in weights.items():
            assert torch.equal(dequantize(w), fp32[name]), name
        assert model.embed_tokens.weight.bits == 5
        assert torch.equal(model.embed_tokens(torch.tensor([5, 49151])), fp32["embed_tokens.weight"][[5, 49151]])
        norms = sum(p.numel() * 4 for p in model.parameters())
        assert quantized_nbytes(model) + norms == planned
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(engine.generate(["Hello"], params)[0].token_ids) == 4


def test_the_default_kv_pool_holds_what_the_engine_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither num_pages nor mem_fraction: max_running_requests x max_model_len tokens
    (+ the padding page), within the default share of free memory."""
    monkeypatch.setattr(engine_setup, "_free_memory_bytes", lambda device: 1 << 34)
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256, "num_hidden_layers": 2,
           "max_position_embeddings": 4096}
    pages, max_len = engine_setup.size_pool(EngineConfig(max_running_requests=4, max_model_len=1000, page_size=16),
                                            cfg, CPU, torch.float32)
    assert (pages, max_len) == (4000 // 16 + 1, 1000)  # + the padding page
    pages, _ = engine_setup.size_pool(EngineConfig(max_running_requests=2), cfg, CPU, torch.float32)
    assert pages == 2 * 4096 + 1


def test_models_inspect_prints_the_costs_without_loading(tiny_gguf: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.cli import main

    monkeypatch.setattr(engine_setup, "_load_weights", _never)
    monkeypatch.setattr("runtime.model.gguf_file.GGUFFile.raw", _never)  # no tensor data is read
    assert main(["models", "inspect", str(tiny_gguf), "--context", "1000", "--concurrency", "4"]) == 0
    out = capsys.readouterr().out
    assert "architecture: llama" in out and "tensor types: Q8_0 x16, F32 x5" in out
    assert "layers 2, hidden 64, heads 4/2, FFN 128, vocab 49152, context 512" in out
    assert f"parameters: {(2 * 49152 * 64 + 64 + 2 * (128 + 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128)) / 1e9:.3f} B" in out
    assert "KV cache (fp32): 512 bytes per token" in out  # 2 layers x 2 KV heads x 16 dims x (K, V) x 4 B
    assert "for 4 x 1000 tokens: KV 0.00 GiB" in out


def test_an_engine_states_its_memory_when_it_starts(tiny_gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="runtime.engine_setup"), Engine(model=str(tiny_gguf), num_pages=1001):
        pass
    assert re.search(r"tiny\.gguf \(gguf weights\): weights 0\.01 GiB \(load peak 0\.01 GiB\), KV pool 1001 tokens "
                     r"x 512 B = 0\.00 GiB; [\d.]+ GiB available", caplog.text)


@pytest.mark.parametrize(("kind", "in_features"), [("Q4_0", 96), ("Q4_1", 576), ("Q4_0", 64)])
def test_q4_blocks_go_straight_to_the_tiled_layout(kind: str, in_features: int) -> None:
    """One byte move from the file's blocks equals converting to rows and then tiling
    (96 and 576 columns: padded to a whole superblock)."""
    import gguf

    from kernels.reference.quant import from_ggml_blocks, tile, tiled_from_q4_blocks

    values = np.random.default_rng(1).standard_normal((48, in_features)).astype(np.float32)
    raw = torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind]))
    direct, via_rows = tiled_from_q4_blocks(raw, kind, in_features), tile(from_ggml_blocks(raw, kind, in_features))
    assert direct.tiled and via_rows.tiled
    for field in ("codes", "scales", "offsets"):
        assert torch.equal(getattr(direct, field), getattr(via_rows, field)), field


def test_the_default_models_blocks_load_tiled_as_before(default_gguf: GGUFFile) -> None:
    """Straight to tiles (``tiles=True``) or rows then ``prepare_quantized``: the same weights."""
    import kernels
    from runtime.model.gguf_weights import load_gguf_model
    from runtime.model.quant import prepare_quantized

    engine_setup.enable_cpu_kernels()
    if not kernels.reads_tiles():
        pytest.skip("environment: the C kernels here do not read tiles (no AVX-512 VNNI)")
    args = ModelArgs.from_hf_config(hf_config(default_gguf))
    direct = load_gguf_model(default_gguf, args, 64, tiles=True)
    via_rows = load_gguf_model(default_gguf, args, 64)
    prepare_quantized(via_rows)
    for name in ("layers.3.self_attn.qkv_proj", "layers.7.mlp.gate_up_proj", "layers.0.mlp.down_proj"):
        a, b = direct.get_submodule(name).weight, via_rows.get_submodule(name).weight
        assert a.tiled and b.tiled and torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


def test_q4_k_parts_go_straight_to_the_tiled_layout(tmp_path: Path) -> None:
    """A fused weight of Q4_K parts (the first un-permuted, as q is) from the map in one C
    pass equals the parts converted to rows, stacked and then tiled."""
    import gguf as gguf_py

    import kernels
    from kernels.reference.quant import tile
    from runtime.model.gguf_weights import GGUFTensors, _unpermute_rows

    engine_setup.enable_cpu_kernels()
    if not kernels.reads_tiles():
        pytest.skip("environment: the C kernels here do not read tiles (no AVX-512 VNNI)")
    rng = np.random.default_rng(2)
    w = gguf_py.GGUFWriter(str(tmp_path / "q4k.gguf"), "llama")
    for name, rows in (("a", 64), ("b", 32)):
        raw = rng.integers(0, 256, (rows, 2, 144), dtype=np.uint8)
        raw[:, :, :4] = rng.uniform(1e-4, 2e-2, (rows, 2, 2)).astype(np.float16).view(np.uint8).reshape(rows, 2, 4)
        w.add_tensor(name, raw.reshape(rows, -1), raw_dtype=gguf_py.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    source = GGUFFile(tmp_path / "q4k.gguf")
    order = _unpermute_rows(4, 64)
    direct = GGUFTensors(source, tiles=True).stacked(["a", "b"], [order, None])
    via_rows = tile(GGUFTensors(source).stacked(["a", "b"], [order, None]))
    source.close()
    assert direct.tiled and (direct.bits, direct.out_features, direct.in_features) == (4, 96, 512)
    for field in ("codes", "scales", "offsets"):
        assert torch.equal(getattr(direct, field), getattr(via_rows, field)), field


@pytest.mark.parametrize("names", [
    ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"],  # Q8_0 q, k beside a Q6_K v
    ["blk.1.ffn_down.weight"], ["output.weight"],  # Q6_K alone
    ["blk.1.ffn_gate.weight", "blk.1.ffn_up.weight"],  # Q8_0
])
def test_mixed_and_q6_k_parts_go_straight_to_the_tiled_layout(names: list[str], tmp_path: Path,
                                                               default_gguf: GGUFFile,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels read tiles, a K-quant mix's weights come from the map in one C pass
    (``kernels.tile_q6_k_blocks``, ``kernels.tile8_blocks``), equal to the torch path's
    (rows converted, widened or requantized, stacked) tiled; q and k un-permuted alike."""
    import kernels
    from kernels import dispatch
    from kernels.reference.quant import tile
    from runtime.model.gguf_weights import GGUFTensors, _unpermute_rows

    engine_setup.enable_cpu_kernels()
    if not kernels.reads_tiles():
        pytest.skip("environment: the C kernels here do not read tiles (no AVX-512 VNNI)")
    path = write_gguf(tmp_path / "mix.gguf", default_gguf, tiny={**TINY, "hidden": 256, "heads": 16, "kv_heads": 8,
                                                                 "ffn": 512}, q6_k=("ffn_down", "output", "attn_v"))
    source = GGUFFile(path)
    orders = [_unpermute_rows(16, 256), _unpermute_rows(8, 128), None] if len(names) == 3 else None
    calls: list[str] = []

    def counted(name: str) -> Any:
        real = getattr(kernels, name)
        return lambda *args: (calls.append(name), real(*args))[1]

    for name in ("tile_q6_k_blocks", "tile8_blocks"):
        monkeypatch.setattr(kernels, name, counted(name))
    try:
        direct = GGUFTensors(source, tiles=True).stacked(names, orders)
        used = list(calls)
        dispatch.set_kernel_backend("torch")  # no C kernel in use: the torch path
        via_torch = tile(GGUFTensors(source, tiles=True).stacked(names, orders))
    finally:
        dispatch.set_kernel_backend("auto")
        source.close()
    assert used == ["tile_q6_k_blocks" if names[0].endswith(("down.weight", "output.weight")) else "tile8_blocks"]
    assert direct.tiled and direct.bits == (6 if used == ["tile_q6_k_blocks"] else 8)
    for field in ("codes", "scales", "offsets"):
        assert torch.equal(getattr(direct, field), getattr(via_torch, field)), field


# ---- load time ---------------------------------------------------------------------------------
def test_the_file_is_prefetched_then_tokenizer_and_weights_load_with_the_gc_paused(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In order: the file's tensor data handed to the kernel's read-ahead, the tokenizer
    built, the weights loaded — the cyclic gc off for all three and on again after; the
    engine gets the file's tokenizer."""
    import gc

    events: list[tuple[str, bool]] = []
    real_prefetch, real_tokenizer, real_load = GGUFFile.prefetch, engine_setup.gguf_tokenizer, \
        engine_setup._load_weights

    def prefetch(self: GGUFFile) -> None:
        events.append(("prefetch", gc.isenabled()))
        real_prefetch(self)

    def tokenizer(gguf: GGUFFile) -> Any:
        events.append(("tokenizer", gc.isenabled()))
        return real_tokenizer(gguf)

    def load(*args: Any) -> Any:
        events.append(("weights", gc.isenabled()))
        return real_load(*args)

    monkeypatch.setattr(GGUFFile, "prefetch", prefetch)
    monkeypatch.setattr(engine_setup, "gguf_tokenizer", tokenizer)
    monkeypatch.setattr(engine_setup, "_load_weights", load)
    assert gc.isenabled()
    with Engine(model=str(tiny_gguf), num_pages=64, freeze_gc=False) as engine:
        assert gc.isenabled()
        file = GGUFFile(tiny_gguf)
        assert engine.tokenizer("Hello world")["input_ids"] == real_tokenizer(file)("Hello world")["input_ids"]
        file.close()
    assert events == [("prefetch", False), ("tokenizer", False), ("weights", False)]


def test_a_tokenizer_that_cannot_be_built_fails_the_load(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its error is the load's (``ModelLoadError``), before any weight is read; gc is on again."""
    import gc

    def broken(gguf: GGUFFile) -> Any:
        raise ModelLoadError(f"{gguf.path}: cannot build the tokenizer from the metadata: broken")

    monkeypatch.setattr(engine_setup, "gguf_tokenizer", broken)
    monkeypatch.setattr(engine_setup, "_load_weights", _never)
    with pytest.raises(ModelLoadError, match="cannot build the tokenizer from the metadata: broken"):
        Engine(model=str(tiny_gguf), num_pages=64)
    assert gc.isenabled()


def test_a_load_prefetches_the_files_tensor_data(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its weights are read, the whole tensor data of the file is handed to the
    kernel's read-ahead (``POSIX_FADV_WILLNEED``), so a file not in the page cache is read
    while the load does other work."""
    import os

    calls: list[tuple[int, int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: (
        calls.append((offset, length, advice)), real(fd, offset, length, advice))[1])
    file = GGUFFile(tiny_gguf)
    data = (file.data_start, file.file_size - file.data_start, os.POSIX_FADV_WILLNEED)
    file.close()
    with Engine(model=str(tiny_gguf), num_pages=64):
        pass
    assert calls == [data]


def test_a_model_that_cannot_fit_in_the_meminfo_available_is_refused(tiny_gguf: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's MemAvailable (a fake /proc/meminfo here) against weights + KV pool: a pool
    of 2 GiB where 1 GiB is available is refused with both numbers, before the weights or
    the tokenizer are read; the same engine loads where 3 GiB are available (the pool's
    memory is untouched until used)."""
    from runtime.model import memory

    meminfo = tmp_path / "meminfo"
    monkeypatch.setattr(engine_setup, "available_memory_bytes", lambda: memory.available_memory_bytes(str(meminfo)))
    pages = (2 << 30) // (512 * 16)  # 512 B of KV a token (2 layers x 2 KV heads x 16 dims x K, V x 4 B)
    meminfo.write_text("MemTotal:       25000000 kB\nMemFree:          100000 kB\nMemAvailable:    1048576 kB\n")
    with monkeypatch.context() as patched:
        patched.setattr(engine_setup, "_load_weights", _never)
        patched.setattr(engine_setup, "gguf_tokenizer", _never)
        with pytest.raises(ModelLoadError, match=r"does not fit in memory: needs 2\.0\d GiB .*KV pool 4194304 tokens "
                                                 r"x 512 B = 2\.00 GiB; 1\.0 GiB available"):
            Engine(model=str(tiny_gguf), num_pages=pages, page_size=16)
    meminfo.write_text("MemTotal:       25000000 kB\nMemAvailable:    3145728 kB\n")
    with Engine(model=str(tiny_gguf), num_pages=pages, page_size=16) as engine:
        assert engine.pool.num_pages == pages


def test_without_a_memavailable_line_the_free_pages_count(tmp_path: Path) -> None:
    """An old kernel's /proc/meminfo (no MemAvailable) or none at all: sysconf's free pages."""
    import os

    from runtime.model.memory import available_memory_bytes

    (tmp_path / "meminfo").write_text("MemTotal:       25000000 kB\nMemFree:          100000 kB\n")
    for path in (tmp_path / "meminfo", tmp_path / "missing"):
        free = available_memory_bytes(str(path))
        assert abs(free - os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) < 256 << 20
