"""Quantized weights in the model: the module swap on tiny random models (logits near
fp32's), the engine's ``weights`` setting and its refusals, and on the default model:
GGUF-native weights equal to the converted fp32 ones and next-token agreement gates."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from kernels.reference.quant import dequantize
from runtime import Engine, SamplingParams
from runtime.cli import build_parser, engine_kwargs
from runtime.config import EngineConfig
from runtime.errors import InvalidRequestError, ModelLoadError
from runtime.model.attention import AttentionMetadata
from runtime.model.kv_cache import KVCache
from runtime.model.llama import LlamaForCausalLM
from runtime.model.loader import load_model, resolve_model_dir
from runtime.model.quant import (
    QuantizedEmbedding,
    QuantizedLinear,
    prepare_quantized,
    quantize_model,
    quantized_nbytes,
)

CPU = torch.device("cpu")
PAGE = 512  # one page holds a whole test sequence


def all_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:  # [T, vocab]
    """Teacher-forced logits of every position: one prefill into page 1."""
    n, args = len(ids), model.args
    kv = KVCache(args.num_layers, 2, PAGE, args.num_kv_heads, args.head_dim, torch.float32, CPU)

    def i32(v: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int32)

    meta = AttentionMetadata(
        kv=kv, out_slots=PAGE + torch.arange(n), num_extend_tokens=n, extend_page_table=i32([[1]]),
        extend_prefix_lens=i32([0]), extend_lens=i32([n]), extend_qo_indptr=i32([0, n]),
        decode_page_table=torch.zeros(0, 1, dtype=torch.int32), decode_seq_lens=i32([]),
    )
    return model(torch.tensor(ids), torch.arange(n), meta, torch.arange(n))


IDS = [1, 504, 3120, 42, 9, 30000, 77, 1234, 8, 4000, 12, 999]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
# NOTE: random Gaussian weights are int4's worst case (~8% error per weight, measured 0.30-0.32
# here over 2 layers); int8 measured 0.025-0.032 (the tiny models' random weights depend on
# the test order's RNG state); a mis-wired swap (wrong rows, lost bias) gives ~1.4.
@pytest.mark.parametrize("fmt,max_rel", [("int8", 0.05), ("int4", 0.45)])
def test_quantized_model_stays_near_fp32(arch: str, fmt: str, max_rel: float,
                                         request: pytest.FixtureRequest) -> None:
    """Every linear, the head and the table swapped (Qwen2: q/k/v bias kept, tied table
    shared by the lookup and the head); logits within the format's error of fp32's."""
    model_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    fp32 = load_model(model_dir, CPU, torch.float32, max_positions=64)
    want = all_logits(fp32, IDS)
    model = load_model(model_dir, CPU, torch.float32, max_positions=64)
    quantize_model(model, fmt)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert not linears and isinstance(model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear)
    if arch == "qwen2":
        assert model.lm_head.weight is model.embed_tokens.weight
        assert model.layers[0].self_attn.qkv_proj.bias is not None  # type: ignore[union-attr]
    got = all_logits(model, IDS)
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert rel < max_rel, rel
    fp32_bytes = sum(p.numel() * 4 for p in fp32.parameters())
    assert quantized_nbytes(model) < fp32_bytes * 0.3  # the int8 table dominates a tiny model
    bits = {m.weight.bits for m in model.layers.modules() if isinstance(m, QuantizedLinear)}
    assert bits == {8 if fmt == "int8" else 4} and model.lm_head.weight.bits == 8


def test_quantize_model_refuses_an_unknown_format(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, CPU, torch.float32, max_positions=64)
    with pytest.raises(ValueError, match="unknown quantized format 'int3'"):
        quantize_model(model, "int3")


def test_engine_weights_setting_and_its_refusals(tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="weights must be one of"):
        EngineConfig(weights="int3")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="computes in float32"):
        Engine(model=str(tiny_llama_dir), weights="int8", dtype="bfloat16")
    with pytest.raises(ModelLoadError, match="needs a .gguf model file"):
        Engine(model=str(tiny_llama_dir), weights="gguf")
    args = build_parser().parse_args(["serve", "--weights", "int4"])
    assert engine_kwargs(args)["weights"] == "int4"


def test_engine_generates_with_int8_weights(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for weights in ("fp32", "int8"):
        engine = Engine(model=str(tiny_llama_dir), weights=weights, num_pages=256, page_size=4)
        outs[weights] = engine.generate(input_ids=[IDS], sampling_params=params)[0].token_ids
        engine.close()
    assert len(outs["int8"]) == 8
    assert outs["int8"][:2] == outs["fp32"][:2]  # random weights: only the first steps are margin-safe


def _mapped(path: Path) -> bool:
    """Whether this process maps ``path`` (Linux: /proc/self/maps)."""
    return any(line.rstrip().endswith(str(path)) for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="environment: no /proc (not Linux)")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_engine_lets_go_of_the_fp32_checkpoint(fmt: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Converting weights keeps nothing that views the mmapped safetensors file (a norm
    weight left as a view kept the whole file's pages resident), and the heap that the
    conversion freed goes back to the OS where glibc can."""
    from runtime.engine_setup import return_freed_heap

    model_dir = tmp_path / "model"  # a file of its own: other engines of this process map theirs
    shutil.copytree(tiny_llama_dir, model_dir)
    checkpoint = (model_dir / "model.safetensors").resolve()
    engine = Engine(model=str(model_dir), weights=fmt, num_pages=64)
    try:
        assert not _mapped(checkpoint)
    finally:
        engine.close()
    # The check itself sees a mapping: fp32 weights keep the file's tensors as they are.
    fp32 = Engine(model=str(model_dir), weights="fp32", num_pages=64)
    try:
        assert _mapped(checkpoint)
    finally:
        fp32.close()
    assert return_freed_heap() == (platform.libc_ver()[0] == "glibc")


# ---- the default model (slow: loads it two to four times) ----------------------------------
PROMPTS = [
    "The capital of France is", "def fibonacci(n):\n    ", "Photosynthesis is the process by which",
    "Once upon a time, in a small village,", "The three primary colors are",
    "To make a cup of tea, first", "import numpy as np\nx = np.", "The largest planet in the solar system",
]
# NOTE: the gates are 0.95, not the 0.97 the quantized formats were asked to reach, and
# that is a sample-size allowance, not a lower bar: `arbor eval` (539 positions) measures
# int8 at 0.978, int4 0.980 and gguf 0.981 top-1 agreement with fp32 (docs/models.md). On these 250
# positions one flipped near-tie is 0.4 points and the standard error of a 0.97 rate is
# ~1.1 points, so 0.95 is 0.97 less two standard errors: a format that really fell below
# 0.97 by more than noise fails here; measured here: int8 0.964, int4 0.968, gguf 0.960
# (tiled weights, Zen 4). The KL gates carry the finer signal.
MIN_AGREEMENT = {"int8": 0.95, "int4": 0.95, "gguf": 0.95}
MAX_MEAN_KL = {"int8": 0.015, "int4": 0.01, "gguf": 0.006}


@pytest.fixture(scope="module")
def fp32_reference(cpu_kernels_enabled: None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt followed by 24 greedy fp32 tokens (the engine's), and the fp32 logits of
    every position."""
    engine = Engine(model="default", weights="fp32", speculation=False, num_pages=1024)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    engine.close()
    seqs = [[*p, *o.token_ids] for p, o in zip(prompts, outs, strict=True)]
    model = load_model(resolve_model_dir("default"), CPU, torch.float32, 2048)
    model.prepack_linears()
    return seqs, [all_logits(model, s) for s in seqs]


def _default_gguf_model() -> LlamaForCausalLM:
    from runtime.model.gguf_config import hf_config
    from runtime.model.gguf_file import GGUFFile
    from runtime.model.gguf_weights import load_gguf_model
    from runtime.model.llama import ModelArgs
    from runtime.model.loader import gguf_file

    gguf = GGUFFile(gguf_file("default"))
    try:
        return load_gguf_model(gguf, ModelArgs.from_hf_config(hf_config(gguf)), 2048)
    finally:
        gguf.close()


def _quantized_default(fmt: str) -> LlamaForCausalLM:
    model_dir = resolve_model_dir("default")
    if fmt == "gguf":
        model = _default_gguf_model()
    else:
        model = load_model(model_dir, CPU, torch.float32, 2048)
        quantize_model(model, fmt)
    prepare_quantized(model)  # NOTE: the layout an engine runs (tiled on AVX-512 VNNI)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "int4", "gguf"])
def test_next_token_agreement_with_fp32(fmt: str, fp32_reference: tuple[list[list[int]], list[torch.Tensor]],
                                        cpu_kernels_enabled: None) -> None:
    """Top-1 agreement and mean KL(fp32 || quantized) at every position of fp32's own
    greedy continuations."""
    seqs, ref = fp32_reference
    model = _quantized_default(fmt)
    agree = total = 0
    kl = 0.0
    for ids, want in zip(seqs, ref, strict=True):
        got = all_logits(model, ids)
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        kl += torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                         reduction="sum").item()
        total += len(ids)
    print(f"{fmt}: top-1 agreement {agree / total:.3f}, mean KL {kl / total:.4f} over {total} positions")
    assert agree / total >= MIN_AGREEMENT[fmt], (fmt, agree / total)
    assert kl / total <= MAX_MEAN_KL[fmt], (fmt, kl / total)


@pytest.mark.slow
def test_gguf_native_weights_equal_the_converted_fp32_ones() -> None:
    """The file's blocks, read from its map, un-permuted and fused, are exactly what the
    fp32 conversion (transformers' dequantizer + reverse permutation) produced."""
    fp32 = load_model(resolve_model_dir("default"), CPU, torch.float32, 2048)
    native = _default_gguf_model()
    pairs = [(native.embed_tokens, fp32.embed_tokens)]
    for ours, theirs in zip(native.layers, fp32.layers, strict=True):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            pairs.append((ours.get_submodule(name), theirs.get_submodule(name)))
        torch.testing.assert_close(ours.input_layernorm.weight, theirs.input_layernorm.weight, atol=0, rtol=0)
    for ours_mod, theirs_mod in pairs:
        assert isinstance(ours_mod, QuantizedLinear | QuantizedEmbedding)
        torch.testing.assert_close(dequantize(ours_mod.weight), theirs_mod.weight, atol=1e-7, rtol=0)
    assert native.lm_head is not None and native.lm_head.weight is native.embed_tokens.weight  # tied


def test_gguf_parts_of_mixed_code_widths_stack_exactly() -> None:
    """A file's q and k in a 4-bit type and its v in an 8-bit one (Q8_0, Q5_*, or Q6_K
    requantized in groups of 32) fuse without requantizing: the 4-bit parts are widened.
    Parts in different groups are requantized to int8 per channel, as before."""
    from kernels.reference.quant import quantize_int4, quantize_int8
    from runtime.model.gguf_weights import _fused

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 64, generator=gen) for n in (32, 16, 16))
    parts = [quantize_int4(q), quantize_int4(k), quantize_int8(v, blocks_per_group=1)]
    fused = _fused("qkv", parts)
    assert (fused.bits, fused.blocks_per_group) == (8, 1)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts]))
    requantized = _fused("qkv", [quantize_int4(q), quantize_int8(v)])
    assert (requantized.bits, requantized.blocks_per_group) == (8, None)
