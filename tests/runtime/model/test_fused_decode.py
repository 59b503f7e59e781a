"""The fused decode step (one native call per decode-only batch) against its reference, the
layer-by-layer path: the same K/V written to the pool and the same logits, bit for bit
(both run the same serial pieces, and attention merges the same 256-position partials in
the same order), whatever the batch; greedy tokens equal through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels
from kernels import UnsupportedDecodeModel
from kernels.reference.quant import quantize_int8
from runtime import Engine, SamplingParams
from runtime.model.fused_decode import FusedDecode
from runtime.model.kv_cache import KVCache
from runtime.model.loader import load_model
from runtime.model.quant import QuantizedLinear, prepare_quantized, quantize_model
from runtime.model.runner import ModelRunner
from runtime.scheduler.batch import ForwardBatch, ForwardSeq

CPU = torch.device("cpu")
NUM_PAGES = 1200


@pytest.fixture(autouse=True)
def _kernels_on(cpu_kernels_enabled: None) -> None:
    """Every test here compares against the layer-by-layer path with the C kernels on."""


def _model(model_dir: Path, fmt: str, tiles: bool = False) -> torch.nn.Module:
    """The model quantized to ``fmt``, its weights tiled when ``tiles`` (the engine's load on
    AVX-512 VNNI; skips elsewhere), else in the row layout (the AVX-512 row kernel)."""
    model = load_model(model_dir, CPU, torch.float32, 1024)
    quantize_model(model, fmt)
    if tiles:
        native = kernels.dispatch._cpu_in_use()
        assert native is not None, "the C kernels are enabled for every test here"
        if not native.quant_linear.tiles:
            pytest.skip(f"environment: this CPU's kernels ({native.quant_linear.path}) have no "
                        "AVX-512 VNNI path, which tiles")
        prepare_quantized(model)
        assert all(m.weight.tiled for m in model.modules() if isinstance(m, QuantizedLinear))
    return model


def _runners(model: torch.nn.Module, page_size: int, kv_dtype: torch.dtype) -> tuple[ModelRunner, ModelRunner]:
    """(layer by layer, fused) over two pools of one shape."""
    a = model.args
    pools = [KVCache(a.num_layers, NUM_PAGES, page_size, a.num_kv_heads, a.head_dim, kv_dtype, CPU) for _ in range(2)]
    return (ModelRunner(model, pools[0], CPU),
            ModelRunner(model, pools[1], CPU, FusedDecode.build(model, pools[1], CPU)))


def _prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(sum(lengths))
    return [[1, *torch.randint(1000, 40000, (n - 1,), generator=gen).tolist()] for n in lengths]


class Seqs:
    """Requests laid out on disjoint pages; each step appends one token to each."""

    def __init__(self, prompts: list[list[int]], page_size: int) -> None:
        self.page_size, self.tokens, self.pages = page_size, [list(p) for p in prompts], []
        next_page = 1  # NOTE: page 0 is the padding page
        for p in prompts:
            count = -(-(len(p) + 8) // page_size)  # room for 8 decode steps
            self.pages.append(tuple(range(next_page, next_page + count)))
            next_page += count
        assert next_page <= NUM_PAGES

    def prefill(self) -> ForwardBatch:
        return ForwardBatch(tuple(ForwardSeq(f"r{i}", tuple(t), 0, self._pages(i, len(t)), "last")
                                  for i, t in enumerate(self.tokens)), ())

    def decode(self, new: list[int]) -> ForwardBatch:
        for t, n in zip(self.tokens, new, strict=True):
            t.append(n)
        return ForwardBatch((), tuple(ForwardSeq(f"r{i}", (t[-1],), len(t) - 1, self._pages(i, len(t)), "last")
                                      for i, t in enumerate(self.tokens)))

    def _pages(self, i: int, length: int) -> tuple[int, ...]:
        return self.pages[i][: -(-length // self.page_size)]


def _slots(seqs: Seqs) -> torch.Tensor:
    """Pool slots of every request's newest token."""
    return torch.tensor([seqs.pages[i][(len(t) - 1) // seqs.page_size] * seqs.page_size
                         + (len(t) - 1) % seqs.page_size for i, t in enumerate(seqs.tokens)])


def _assert_same_kv(a: KVCache, b: KVCache, slots: torch.Tensor) -> None:
    """Every layer's new K/V (and scales), bit for bit."""
    for layer in range(len(a.k)):
        for x, y in zip(a.layer(layer), b.layer(layer), strict=True):
            if x is not None and y is not None:
                assert torch.equal(x[slots].view(torch.uint8), y[slots].view(torch.uint8)), layer


# NOTE: 600 tokens make 3 attention partials (256 + 256 + 88), spread over both threads by
# the fused step and merged in one thread by the layer-by-layer kernel.
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("tiles", [False, True], ids=["rows", "tiles"])
def test_fused_steps_equal_the_layer_by_layer_path(fmt: str, kv_dtype: torch.dtype, page_size: int,
                                                    tiles: bool, tiny_llama_dir: Path) -> None:
    model = _model(tiny_llama_dir, fmt, tiles)
    eager, fused = _runners(model, page_size, kv_dtype)
    for lengths in ([600], [5, 300, 17], [3, 9, 33, 70, 2]):
        seqs = Seqs(_prompts(lengths), page_size)
        with torch.inference_mode():
            first = eager.forward(seqs.prefill())
            fused.forward(seqs.prefill())  # NOTE: a prefill takes the layer-by-layer path in both
            new = first.logits.argmax(dim=-1).tolist()
            for _ in range(3):
                batch = seqs.decode(new)
                want, got = eager.forward(batch), fused.forward(batch)
                assert got.sample_ids == want.sample_ids == [f"r{i}" for i in range(len(lengths))]
                assert torch.equal(got.logits, want.logits)
                _assert_same_kv(eager.kv, fused.kv, _slots(seqs))
                new = want.logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_batches_past_the_kernels_limit_run_layer_by_layer(fmt: str, tiny_llama_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the layer-by-layer linears leave the kernel above some batch size (a bf16
    matmul with AVX512_BF16, fp32 F.linear without AVX-512), the fused step takes batches
    up to that size, so both paths compute the same bits at every size. The split itself
    runs with a limit of 5 rows forced, so it is checked on every CPU."""
    model = _model(tiny_llama_dir, fmt)
    _, fused = _runners(model, 4, torch.float32)
    assert fused.fused is not None
    limits = {kernels.quant_kernel_max_rows(m.weight) for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert fused.fused.max_batch == min((n for n in limits if n is not None), default=None)
    monkeypatch.setattr(kernels.dispatch, "_kernel_max_rows", lambda kernel, weight: 5)
    eager, fused = _runners(model, 4, torch.float32)
    assert fused.fused is not None and fused.fused.max_batch == 5
    seqs = Seqs(_prompts([3 + i % 5 for i in range(6)]), 4)
    called = []
    step = fused.fused.step
    fused.fused.step = lambda *a: called.append(1) or step(*a)  # type: ignore[method-assign]
    with torch.inference_mode():
        new = eager.forward(seqs.prefill()).logits.argmax(dim=-1).tolist()
        fused.forward(seqs.prefill())
        batch = seqs.decode(new)
        assert torch.equal(fused.forward(batch).logits, eager.forward(batch).logits) and not called
        fused.forward(ForwardBatch((), batch.decode[:5]))
        assert called == [1]


@pytest.mark.parametrize("tiles", [False, True], ids=["rows", "tiles"])
def test_q6_k_weights_beside_4_bit_ones(tiles: bool, tiny_llama_256_dir: Path) -> None:
    """A Q4_K_M-like mix: the MLP's down projection and the LM head in Q6_K (6-bit codes,
    int8 sub-block scales), every other weight 4-bit; the fused step is still the
    layer-by-layer path bit for bit."""
    from kernels.reference.quant import quantize_q6_k

    model = load_model(tiny_llama_256_dir, CPU, torch.float32, 1024)
    down = [quantize_q6_k(layer.mlp.down_proj.weight.detach()) for layer in model.layers]
    head = quantize_q6_k(model.lm_head.weight.detach())
    quantize_model(model, "int4")
    for layer, weight in zip(model.layers, down, strict=True):
        layer.mlp.down_proj = QuantizedLinear(weight)
    model.lm_head = QuantizedLinear(head)
    _fused_equals_eager_on_a_mix(model, tiles, head_bits=6)


def _fused_equals_eager_on_a_mix(model: torch.nn.Module, tiles: bool, head_bits: int) -> None:
    """A model of mixed weight formats (tiled first where ``tiles``; the LM head then holds
    ``head_bits``-bit tiles): the fused step's logits equal the layer-by-layer path's, bit for
    bit, over a prefill and two decode steps."""
    if tiles:
        native = kernels.dispatch._cpu_in_use()
        assert native is not None
        if not native.quant_linear.tiles:
            pytest.skip(f"environment: this CPU's kernels ({native.quant_linear.path}) do not tile")
        prepare_quantized(model)
        assert model.lm_head.weight.tiled and model.lm_head.weight.bits == head_bits
    eager, fused = _runners(model, 4, torch.float32)
    seqs = Seqs(_prompts([9, 300, 2]), 4)
    with torch.inference_mode():
        new = eager.forward(seqs.prefill()).logits.argmax(dim=-1).tolist()
        fused.forward(seqs.prefill())
        for _ in range(2):
            batch = seqs.decode(new)
            want = eager.forward(batch)
            assert torch.equal(fused.forward(batch).logits, want.logits)
            new = want.logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("tiles", [False, True], ids=["rows", "tiles"])
def test_5_bit_weights_beside_4_and_8_bit_ones(tiles: bool, tiny_llama_dir: Path) -> None:
    """A mix like the default model's Q4_K_M file: attention and the LM head in 5-bit
    codes (Q5_0 / Q5_1's layout), the MLP's gate/up 8-bit and down 4-bit; the fused step
    is still the layer-by-layer path bit for bit, in rows and in tiles."""
    from kernels.reference.quant import quantize_int5

    model = load_model(tiny_llama_dir, CPU, torch.float32, 1024)
    five = {id(layer): (quantize_int5(layer.self_attn.qkv_proj.weight.detach()),
                        quantize_int5(layer.self_attn.o_proj.weight.detach())) for layer in model.layers}
    head = quantize_int5(model.lm_head.weight.detach())
    gate_up = [layer.mlp.gate_up_proj.weight.detach() for layer in model.layers]
    quantize_model(model, "int4")
    for layer, weight in zip(model.layers, gate_up, strict=True):
        qkv, o = five[id(layer)]
        layer.self_attn.qkv_proj = QuantizedLinear(qkv)
        layer.self_attn.o_proj = QuantizedLinear(o)
        layer.mlp.gate_up_proj = QuantizedLinear(quantize_int8(weight, blocks_per_group=1))
    model.lm_head = QuantizedLinear(head)
    _fused_equals_eager_on_a_mix(model, tiles, head_bits=5)


def test_qkv_bias_and_tied_head(tiny_qwen2_dir: Path) -> None:
    """Qwen2: q/k/v carry a bias; the head is the (quantized) embedding table."""
    model = _model(tiny_qwen2_dir, "int8")
    eager, fused = _runners(model, 4, torch.float32)
    seqs = Seqs(_prompts([12, 30]), 4)
    with torch.inference_mode():
        new = eager.forward(seqs.prefill()).logits.argmax(dim=-1).tolist()
        fused.forward(seqs.prefill())
        batch = seqs.decode(new)
        assert torch.equal(fused.forward(batch).logits, eager.forward(batch).logits)


def test_an_mlp_width_off_the_tile_grid(tiny_llama_mlp40_dir: Path) -> None:
    """intermediate 40: the fused step's gate rows [0, 40) and up rows [40, 80) each cut a
    16-row tile of the tiled gate/up weight, whose outputs are then stored in part."""
    model = _model(tiny_llama_mlp40_dir, "int4", tiles=True)
    eager, fused = _runners(model, 4, torch.float32)
    seqs = Seqs(_prompts([7, 20, 3]), 4)
    with torch.inference_mode():
        new = eager.forward(seqs.prefill()).logits.argmax(dim=-1).tolist()
        fused.forward(seqs.prefill())
        for _ in range(2):
            batch = seqs.decode(new)
            want = eager.forward(batch)
            assert torch.equal(fused.forward(batch).logits, want.logits)
            new = want.logits.argmax(dim=-1).tolist()


def test_models_it_does_not_take_are_refused_by_name(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, CPU, torch.float32, 1024)
    a = model.args
    kv = KVCache(a.num_layers, 8, 4, a.num_kv_heads, a.head_dim, torch.float32, CPU)
    with pytest.raises(UnsupportedDecodeModel, match=r"layers\[0\].qkv_proj is Linear, not a quantized linear"):
        FusedDecode.build(model, kv, CPU)
    quantize_model(model, "int8")
    with pytest.raises(UnsupportedDecodeModel, match="runs on the CPU"):
        FusedDecode.build(model, kv, torch.device("meta"))
    kernels.set_kernel_backend("torch")
    try:
        with pytest.raises(UnsupportedDecodeModel, match="native CPU kernels are not in use"):
            FusedDecode.build(model, kv, CPU)
    finally:
        kernels.set_kernel_backend("auto")


def test_out_of_range_inputs_are_refused(tiny_llama_dir: Path) -> None:
    model = _model(tiny_llama_dir, "int8")
    a = model.args
    kv = KVCache(a.num_layers, 8, 4, a.num_kv_heads, a.head_dim, torch.float32, CPU)
    step = FusedDecode.build(model, kv, CPU)
    ids, pos, table = torch.tensor([5]), torch.tensor([2]), torch.tensor([[1]], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside the KV pool"):
        step.forward(ids, pos, torch.tensor([32]), table, lens)  # slot 32 of a 32-slot pool
    with pytest.raises(ValueError, match="outside the KV pool"):
        step.forward(ids, pos, torch.tensor([6]), table, torch.tensor([5], dtype=torch.int32))  # 5 > 1 page
    with pytest.raises(ValueError, match="outside the KV pool"):
        step.forward(ids, pos, torch.tensor([6]), torch.tensor([[9]], dtype=torch.int32), lens)  # page 9 of 8
    with pytest.raises(ValueError, match="seq_lens must be torch.int32"):
        step.forward(ids, pos, torch.tensor([6]), table, torch.tensor([3]))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_engine_greedy_tokens_are_the_same_with_and_without(fmt: str, tiny_llama_dir: Path) -> None:
    prompts = _prompts([7, 40, 3, 90, 12, 25])
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    outs = {}
    for on in (False, True):
        engine = Engine(model=str(tiny_llama_dir), weights=fmt, fused_decode=on, speculation=False,
                        page_size=4, num_pages=256)
        assert (engine.runner.fused is not None) == on
        outs[on] = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
        engine.check_integrity()
        engine.close()
    assert outs[True] == outs[False]


def test_fp32_weights_keep_the_layer_by_layer_path(tiny_llama_dir: Path) -> None:
    engine = Engine(model=str(tiny_llama_dir), weights="fp32", num_pages=64)
    assert engine.runner.fused is None  # nothing to fuse: fp32 linears are oneDNN's
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gguf", "int8"])
def test_default_model_greedy_tokens_are_the_same_with_and_without(fmt: str) -> None:
    """The shipped model in its own Q4_1 blocks (and int8): 4 prompts x 48 greedy tokens,
    batched together and alone."""
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    questions = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
    outs = {}
    for on in (False, True):
        engine = Engine(model="default", weights=fmt, fused_decode=on, speculation=False, page_size=16,
                        num_pages=512)
        assert (engine.runner.fused is not None) == on
        together = [o.token_ids for o in engine.generate(questions, params)]
        alone = [engine.generate([q], params)[0].token_ids for q in questions[:2]]
        outs[on] = (together, alone)
        engine.close()
    assert outs[True] == outs[False]


# NOTE: window 300 over 600 tokens leaves the first 256-position partial empty and cuts the
# second; window 7 keeps a query inside one or two 32-position blocks
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("windows", [(300, None), (7, 7)], ids=["window-300-and-global", "window-7"])
def test_windows_and_caps_run_in_the_step(kv_dtype: torch.dtype, windows: tuple[int | None, ...],
                                          tiny_llama_dir: Path) -> None:
    """Sliding windows per layer (Mistral; Gemma's local / global alternation), the attention
    scale and soft-cap, the embedding scale and the logits' soft-cap (Gemma 2's): the fused
    step still equals the layer-by-layer path bit for bit."""
    import dataclasses

    model = _model(tiny_llama_dir, "int8")
    model.args = dataclasses.replace(model.args, layer_windows=windows, attn_scale=0.2, attn_softcap=3.0,
                                     embed_scale=8.0, final_softcap=4.0)
    for layer, window in zip(model.layers, windows, strict=True):
        layer.self_attn.window, layer.self_attn.scale, layer.self_attn.softcap = window, 0.2, 3.0
    eager, fused = _runners(model, 4, kv_dtype)
    assert fused.fused is not None
    for lengths in ([600], [5, 300, 17]):
        seqs = Seqs(_prompts(lengths), 4)
        with torch.inference_mode():
            new = eager.forward(seqs.prefill()).logits.argmax(dim=-1).tolist()
            fused.forward(seqs.prefill())
            for _ in range(3):
                batch = seqs.decode(new)
                want, got = eager.forward(batch), fused.forward(batch)
                assert torch.equal(got.logits, want.logits)
                _assert_same_kv(eager.kv, fused.kv, _slots(seqs))
                new = want.logits.argmax(dim=-1).tolist()
